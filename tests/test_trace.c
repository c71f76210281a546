/* The trace: its rings under many threads, its bound, its refusals, the
 * memory counters, and the file it writes. */
#define _GNU_SOURCE
#include <pthread.h>
#include <unistd.h>

#include "test.h"

#include "laden/dev.h"
#include "laden/trace.h"

/* How many lines of the file contain every one of the strings. */
static size_t lines_with(const char *path, const char *a, const char *b)
{
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    char line[4096];
    size_t n = 0;
    while (fgets(line, sizeof line, f))
        n += strstr(line, a) && (!b || strstr(line, b));
    fclose(f);
    return n;
}

#define THREADS 4
#define PER_THREAD 20000

static void *ranges(void *arg)
{
    (void)arg;
    for (int i = 0; i < PER_THREAD; i++) {
        laden_trace_range("work", 1);
        laden_trace_range(NULL, 0);
    }
    return NULL;
}

/* Threads record at once, each into its own ring: every event arrives,
 * in the file as one B and one E per range. */
TEST(trace_threads_record_every_event)
{
    char *path = test_path("threads.json");
    CHECK_OK(laden_trace_start(0));
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        CHECK(pthread_create(&t[i], NULL, ranges, NULL) == 0);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    laden_trace_result_t r;
    CHECK_OK(laden_trace_stop(path, &r));
    CHECK_EQ(r.dropped, 0);
    CHECK_EQ(r.threads, THREADS); /* their rings outlive them */
    CHECK_EQ(lines_with(path, "\"cat\":\"range\",\"ph\":\"B\"", NULL),
             THREADS * PER_THREAD);
    CHECK_EQ(lines_with(path, "\"cat\":\"range\",\"ph\":\"E\"", NULL),
             THREADS * PER_THREAD);
    CHECK_EQ(lines_with(path, "\"thread_name\"", NULL), THREADS);
    /* A second trace starts from empty rings (of threads gone now). */
    CHECK_OK(laden_trace_start(0));
    laden_trace_range("again", 1);
    laden_trace_range(NULL, 0);
    CHECK_OK(laden_trace_stop(path, &r));
    CHECK_EQ(r.threads, 1);
    CHECK_EQ(lines_with(path, "\"cat\":\"range\"", NULL), 2);
}

/* Past max_events events are dropped and counted, never written. */
TEST(trace_bound_drops_and_counts)
{
    char *path = test_path("bound.json");
    CHECK_OK(laden_trace_start(100));
    for (int i = 0; i < 500; i++)
        laden_trace_range("r", i % 2 == 0);
    laden_trace_result_t r;
    CHECK_OK(laden_trace_stop(path, &r));
    CHECK_EQ(r.dropped, 400);
    CHECK_EQ(lines_with(path, "\"cat\":\"range\"", NULL), 100);
    CHECK_EQ(lines_with(path, "\"dropped_events\":400", NULL), 1);
}

TEST(trace_refuses_misuse)
{
    laden_trace_result_t r;
    CHECK(!laden_trace_active());
    CHECK_STATUS(laden_trace_stop("x.json", &r), LADEN_E_STATE);
    CHECK_OK(laden_trace_start(0));
    CHECK(laden_trace_active());
    CHECK_STATUS(laden_trace_start(0), LADEN_E_STATE);
    /* A path that cannot be written: the error names it, the trace ends. */
    CHECK_STATUS(laden_trace_stop("/nonexistent-dir/t.json", &r),
                 LADEN_E_IO);
    CHECK(strstr(laden_last_error(), "/nonexistent-dir/t.json"));
    CHECK(!laden_trace_active());
    /* Discarded: nothing written, nothing kept for the next trace. */
    CHECK_OK(laden_trace_start(0));
    laden_trace_counter("discarded", LADEN_DEVICE_CPU, 1);
    CHECK_OK(laden_trace_stop(NULL, &r));
    char *path = test_path("after.json");
    CHECK_OK(laden_trace_start(0));
    laden_trace_counter("kept", LADEN_DEVICE_CPU, 2);
    CHECK_OK(laden_trace_stop(path, &r));
    CHECK_EQ(lines_with(path, "discarded", NULL), 0);
    CHECK_EQ(lines_with(path, "\"name\":\"cpu kept\"", NULL), 1);
    /* Off: calls record nothing and cost nothing. */
    laden_trace_counter("x", LADEN_DEVICE_CPU, 1);
    laden_trace_range("x", 1);
}

/* Names with quotes, backslashes and control characters stay valid
 * JSON strings. */
TEST(trace_escapes_names)
{
    char *path = test_path("names.json");
    CHECK_OK(laden_trace_start(0));
    laden_trace_range("a \"quoted\" \\ name\n", 1);
    laden_trace_range(NULL, 0);
    CHECK_OK(laden_trace_stop(path, NULL));
    CHECK_EQ(lines_with(path, "\"name\":\"a \\\"quoted\\\" \\\\ name\\u000a\"",
                        NULL), 1);
    /* UTF-8 kept; bytes that are not (a name cut inside a character)
     * replaced, so the file stays JSON. */
    CHECK_OK(laden_trace_start(0));
    laden_trace_range("caf\xc3\xa9 \xe2\x82\xac", 1);
    laden_trace_range(NULL, 0);
    laden_trace_range("cut \xc3", 1);
    laden_trace_range(NULL, 0);
    laden_trace_range("bad \xff\xfe end", 1);
    laden_trace_range(NULL, 0);
    CHECK_OK(laden_trace_stop(path, NULL));
    CHECK_EQ(lines_with(path, "\"name\":\"caf\xc3\xa9 \xe2\x82\xac\"", NULL),
             1);
    CHECK_EQ(lines_with(path, "\"name\":\"cut \\ufffd\"", NULL), 1);
    CHECK_EQ(lines_with(path, "\"name\":\"bad \\ufffd\\ufffd end\"", NULL),
             1);
}

/* The memory counters follow laden's allocations, starting from where
 * they stood when the trace began. */
TEST(trace_memory_counters)
{
    char *path = test_path("mem.json");
    laden_devptr_t before = 0, p = 0;
    CHECK_OK(laden_dev_mem_alloc(LADEN_DEVICE_CPU, 3u << 20, &before));
    CHECK_OK(laden_trace_start(0));
    CHECK_OK(laden_dev_mem_alloc(LADEN_DEVICE_CPU, 1u << 20, &p));
    CHECK_OK(laden_dev_mem_free(LADEN_DEVICE_CPU, p));
    void *h = NULL;
    CHECK_OK(laden_dev_host_alloc(LADEN_DEVICE_CPU, 8192, &h));
    CHECK_OK(laden_dev_host_free(LADEN_DEVICE_CPU, h));
    laden_trace_counter("torch_allocated_bytes", 0, 12345);
    CHECK_OK(laden_trace_stop(path, NULL));
    CHECK_OK(laden_dev_mem_free(LADEN_DEVICE_CPU, before));
    const char *dev = "\"name\":\"cpu device_bytes\"";
    CHECK_EQ(lines_with(path, dev, "\"bytes\":3145728}"), 2); /* start, free */
    CHECK_EQ(lines_with(path, dev, "\"bytes\":4194304}"), 1);
    CHECK_EQ(lines_with(path, "\"name\":\"cpu pinned_bytes\"",
                        "\"bytes\":8192}"), 1);
    CHECK_EQ(lines_with(path, "\"name\":\"cuda:0 torch_allocated_bytes\"",
                        "\"bytes\":12345}"), 1);
}
