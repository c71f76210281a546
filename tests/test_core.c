#include "test.h"

#include "core/internal.h"

TEST(status_names_and_messages)
{
    CHECK(strcmp(laden_status_name(LADEN_OK), "OK") == 0);
    CHECK(strcmp(laden_status_name(LADEN_E_DTYPE), "E_DTYPE") == 0);
    CHECK(strcmp(laden_status_name(12345), "UNKNOWN") == 0);
    CHECK(strcmp(laden_status_message(LADEN_E_NOMEM), "out of host memory") ==
          0);
    CHECK(strcmp(laden_status_message(-999), "unknown status") == 0);
    /* Every status has a distinct name. */
#define NAME(n, v, m) laden_status_name(v),
    const char *names[] = {LADEN_STATUS_LIST(NAME)};
#undef NAME
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        for (size_t j = i + 1; j < sizeof names / sizeof names[0]; j++)
            CHECK(strcmp(names[i], names[j]) != 0);
}

TEST(last_error_is_thread_local_and_prefixed)
{
    CHECK(laden__fail(LADEN_E_IO, "disk %d on fire", 3) == LADEN_E_IO);
    CHECK(strcmp(laden_last_error(), "disk 3 on fire") == 0);
    laden__error_prefix("reading %s", "x.safetensors");
    CHECK(strcmp(laden_last_error(), "reading x.safetensors: disk 3 on fire") ==
          0);
    char big[3000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    laden__error_prefix("%s", big); /* truncates, never overflows */
    CHECK(strlen(laden_last_error()) < 1024);
}

TEST(version)
{
    CHECK(strcmp(laden_version(), "0.1.0") == 0);
}

TEST(checked_arithmetic)
{
    uint64_t r;
    CHECK(laden__add_u64(1, 2, &r) && r == 3);
    CHECK(!laden__add_u64(UINT64_MAX, 1, &r));
    CHECK(!laden__mul_u64(1ull << 32, 1ull << 32, &r));
}
