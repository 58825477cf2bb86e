/*
 * fabric.kv._copy: run a batch of memcpy calls with the GIL released.
 *
 *   copy_batch(dst_addrs, src_addrs, lengths, num_threads=1, stream=-1) -> None
 *
 * The three arguments are C-contiguous int64 buffers (e.g. numpy arrays) of
 * equal length: copy i moves lengths[i] bytes from address src_addrs[i] to
 * dst_addrs[i]. The addresses are trusted: the Python caller (fabric.kv.pack)
 * derives them from tensors it has validated. With num_threads > 1 the bytes
 * of the whole batch are split into equal contiguous ranges, one per pthread,
 * so a batch of a few large copies still spreads evenly.
 *
 * Large batches are copied with streaming (non-temporal) stores on x86-64:
 * a plain store first reads the destination line into cache (3 bytes of
 * memory traffic per byte copied), a streaming store does not (2 bytes).
 * NOTE: measured on the 2-core dev VM, gathering 32 KiB / 512 KiB KV pages:
 * glibc memcpy 8-11 GB/s, SSE2 streaming 11-16, AVX2 streaming 12-18. glibc
 * itself streams only single copies above ~3/4 of the L3 size. A batch this
 * large (well over the L2) would not stay in cache anyway. stream=1 asks for
 * streaming stores whatever the batch size (copies of at least 4 KiB): a
 * verifying unpack copies one cache-sized piece at a time, out of a source
 * just hashed into cache, into a destination nobody reads soon; stream=0
 * never streams.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

#define MAX_THREADS 64
/* NOTE: below this many bytes per thread, starting a thread costs more than it saves. */
#define MIN_BYTES_PER_THREAD (1 << 20)
/* Batches at least this large use streaming stores, for copies of at least STREAM_MIN_COPY. */
#define STREAM_MIN_BATCH (4 << 20)
#define STREAM_MIN_COPY 4096

static int have_avx2 = 0;

typedef struct {
    const int64_t *dst;
    const int64_t *src;
    const int64_t *len;
    Py_ssize_t count;
    int64_t begin; /* this worker's byte range of the concatenated batch */
    int64_t end;
    int stream; /* use streaming stores */
} Work;

#if HAVE_STREAM
/* dst 64-byte aligned, n a multiple of 128. */
__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n) {
    for (size_t o = 0; o < n; o += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + o));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + o + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + o + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + o + 96));
        _mm256_stream_si256((__m256i *)(d + o), a);
        _mm256_stream_si256((__m256i *)(d + o + 32), b);
        _mm256_stream_si256((__m256i *)(d + o + 64), c);
        _mm256_stream_si256((__m256i *)(d + o + 96), e);
    }
}

/* dst 64-byte aligned, n a multiple of 64. */
static void stream_sse2(char *d, const char *s, size_t n) {
    for (size_t o = 0; o < n; o += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + o));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + o + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + o + 48));
        _mm_stream_si128((__m128i *)(d + o), a);
        _mm_stream_si128((__m128i *)(d + o + 16), b);
        _mm_stream_si128((__m128i *)(d + o + 32), c);
        _mm_stream_si128((__m128i *)(d + o + 48), e);
    }
}

/* memcpy with streaming stores for the cache-line-aligned middle. */
static void copy_stream(char *d, const char *s, size_t n) {
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    head = head < n ? head : n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t body = n & ~(size_t)127;
    if (have_avx2) {
        stream_avx2(d, s, body);
    } else {
        stream_sse2(d, s, body);
    }
    memcpy(d + body, s + body, n - body);
}
#endif

static void copy_one(char *d, const char *s, size_t n, int stream) {
#if HAVE_STREAM
    if (stream && n >= STREAM_MIN_COPY) {
        copy_stream(d, s, n);
        return;
    }
#endif
    (void)stream;
    memcpy(d, s, n);
}

static void copy_range(const Work *w) {
    int64_t pos = 0;
    for (Py_ssize_t i = 0; i < w->count && pos < w->end; i++) {
        int64_t n = w->len[i];
        int64_t lo = w->begin > pos ? w->begin : pos;
        int64_t hi = w->end < pos + n ? w->end : pos + n;
        if (lo < hi) {
            copy_one((char *)(intptr_t)w->dst[i] + (lo - pos),
                     (const char *)(intptr_t)w->src[i] + (lo - pos), (size_t)(hi - lo), w->stream);
        }
        pos += n;
    }
#if HAVE_STREAM
    if (w->stream) {
        _mm_sfence(); /* streaming stores are weakly ordered: publish them before returning */
    }
#endif
}

static void *copy_worker(void *arg) {
    copy_range((const Work *)arg);
    return NULL;
}

static void run_threads(Work *base, int64_t total, int threads) {
    Work work[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        work[t] = *base;
        work[t].begin = total * t / threads;
        work[t].end = total * (t + 1) / threads;
    }
    /* The calling thread does range 0 itself; a failed start runs inline. */
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&ids[t], NULL, copy_worker, &work[t]) == 0;
        if (!started[t]) {
            copy_range(&work[t]);
        }
    }
    copy_range(&work[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(ids[t], NULL);
        }
    }
}

static int get_int64_buffer(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        return -1;
    }
    const char *fmt = view->format ? view->format : "B";
    char code = fmt[strlen(fmt) - 1];
    if (view->itemsize != 8 || (code != 'q' && code != 'l') || view->ndim > 1) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D int64 buffer", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int check_lengths(const int64_t *len, Py_ssize_t count, int64_t *total) {
    *total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (len[i] < 0) {
            PyErr_Format(PyExc_ValueError, "lengths[%zd] is negative", i);
            return -1;
        }
        *total += len[i];
    }
    return 0;
}

static int pick_threads(int requested, int64_t total) {
    int64_t useful = total / MIN_BYTES_PER_THREAD;
    int threads = requested < MAX_THREADS ? requested : MAX_THREADS;
    if (useful < threads) {
        threads = (int)useful;
    }
    return threads < 1 ? 1 : threads;
}

static PyObject *copy_batch(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"dst_addrs", "src_addrs", "lengths", "num_threads", "stream", NULL};
    PyObject *dst_obj, *src_obj, *len_obj;
    int num_threads = 1;
    int stream = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|ii:copy_batch", kwlist, &dst_obj,
                                     &src_obj, &len_obj, &num_threads, &stream)) {
        return NULL;
    }
    Py_buffer dst, src, len;
    if (get_int64_buffer(dst_obj, &dst, "dst_addrs") != 0) {
        return NULL;
    }
    if (get_int64_buffer(src_obj, &src, "src_addrs") != 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (get_int64_buffer(len_obj, &len, "lengths") != 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t count = len.len / 8;
    int64_t total = 0;
    if (dst.len != len.len || src.len != len.len) {
        PyErr_SetString(PyExc_ValueError, "dst_addrs, src_addrs and lengths differ in length");
    } else if (num_threads < 1) {
        PyErr_SetString(PyExc_ValueError, "num_threads must be >= 1");
    } else if (check_lengths((const int64_t *)len.buf, count, &total) == 0) {
        int use_stream = stream < 0 ? total >= STREAM_MIN_BATCH : stream != 0;
        Work base = {dst.buf, src.buf, len.buf, count, 0, total, use_stream};
        int threads = pick_threads(num_threads, total);
        Py_BEGIN_ALLOW_THREADS;
        run_threads(&base, total, threads);
        Py_END_ALLOW_THREADS;
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&len);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_batch", (PyCFunction)(void (*)(void))copy_batch, METH_VARARGS | METH_KEYWORDS,
     "copy_batch(dst_addrs, src_addrs, lengths, num_threads=1, stream=-1)\n--\n\n"
     "memcpy lengths[i] bytes from src_addrs[i] to dst_addrs[i] for every i,\n"
     "with the GIL released, split over num_threads threads. stream: 1 uses\n"
     "streaming stores, 0 does not, -1 (default) does for batches of 4 MiB or more."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fabric.kv._copy",
    .m_doc = "Batched memcpy with the GIL released.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__copy(void) {
#if HAVE_STREAM
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
