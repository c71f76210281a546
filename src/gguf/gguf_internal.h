/* What the gguf layer gives the st layer beyond include/laden/gguf.h. */
#ifndef LADEN_GGUF_INTERNAL_H
#define LADEN_GGUF_INTERNAL_H

#include "laden/gguf.h"

/* laden_gguf_open on a descriptor the caller opened (and closes): the
 * header parsed is the file the caller's fstat describes.  path names it
 * in messages. */
laden_status laden__gguf_open_fd(int fd, const char *path,
                                 laden_gguf_t **out);

#endif
