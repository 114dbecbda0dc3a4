/* The int8 block codec's CPU kernels: one pass over the gradient each way.
 *
 * The same arithmetic as the eager `int8.int8_blocks_encode` / `int8_blocks_decode`, entry
 * for entry (tests/test_int8_kernel.py compares the bytes), with no temporaries: each
 * 64-entry block is read once from memory for its maximum and again from L1 for its codes.
 * The eager path makes five passes over memory to encode and two to decode.
 *
 * Python hands over addresses of tensors it has checked (`int8.py`); nothing here knows
 * torch. The work is split over `threads` POSIX threads by whole blocks; the GIL is
 * released meanwhile, so no Python object is touched off the calling thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#ifndef _WIN32
#include <pthread.h>
#endif

#define BLOCK 64
#define MAX_THREADS 64
/* Below this many entries (8 MiB of fp32) one thread does it all: starting a thread, and
 * sharing a core with the PyTorch pool threads that spin between operators (in a backward
 * hook), costs more than the split saves (perf/RESULTS.md, "The int8 kernels"). */
#define MIN_PARALLEL (1 << 21)

/* x86-64 with GCC or Clang: full blocks through AVX2 where the CPU has it (checked when the
 * module loads), the portable loops below otherwise. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_PATH 1
#include <immintrin.h>
#endif

/* Whether whole blocks take the AVX2 path: set when the module loads, where the CPU has
 * AVX2; `use_avx2(False)` sends them down the portable loops (the tests run both). */
static int avx2_supported = 0;
static int use_avx2 = 0;

typedef struct {
    const float *x;
    const float *const *windows; /* one noise window per chunk of `chunk` entries */
    int8_t *codes;
    float *scales;
    float *out;
    Py_ssize_t count; /* entries */
    Py_ssize_t chunk;
    float step;
    Py_ssize_t first_block, stop_block;
} Work;

/* A block's scale: its largest magnitude times `step`. The maximum is taken over the float
 * bits with the sign cleared: for non-NaN floats their order as unsigned integers is their
 * order as magnitudes, and every NaN sorts above +inf, so the maximum's bits are NaN
 * exactly when the block holds one (as torch.amax propagates it). */
static float scale_of(uint32_t top, float step) {
    float largest;
    memcpy(&largest, &top, sizeof largest);
    return largest * step;
}

/* An all-zero block (scale +0) codes 0; a non-finite scale decodes every entry of its
 * block as non-finite whatever the codes, so they are 0 too. */
static int codes_are_zero(float scale) { return !(scale > 0.0f) || scale > 3.4028234663852886e38f; }

/* One block of `len` entries, portably: noise + x / scale, floored (in [-127, 127] for every
 * finite entry: int8.py's SCALE_MARGIN); truncation, then one down where it rounded up, is
 * the floor. Returns the scale. */
static float encode_block(const float *x, const float *noise, int8_t *codes, Py_ssize_t len,
                          float step) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t top = 0;
    for (Py_ssize_t i = 0; i < len; i++) {
        uint32_t magnitude = bits[i] & 0x7fffffffu;
        top = magnitude > top ? magnitude : top;
    }
    float scale = scale_of(top, step);
    if (codes_are_zero(scale)) {
        memset(codes, 0, BLOCK);
        return scale;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        float level = noise[i] + x[i] / scale;
        int code = (int)level;
        code -= (float)code > level;
        codes[i] = (int8_t)code;
    }
    memset(codes + len, 0, BLOCK - len); /* the last block's padding */
    return scale;
}

#ifdef HAVE_AVX2_PATH
/* One whole block with AVX2, the same arithmetic as `encode_block`: eight vectors of eight
 * entries, the same IEEE divide, add and floor, packed to int8. The packs saturate, which
 * never happens while every code is within [-127, 127]; were SCALE_MARGIN lost, they would
 * clamp a 128 where the portable cast wraps it (tests/test_codecs.py checks both paths). */
__attribute__((target("avx2"))) static float encode_block_avx2(const float *x,
                                                               const float *noise,
                                                               int8_t *codes, float step) {
    __m256 values[8];
    __m256i top = _mm256_setzero_si256();
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    for (int k = 0; k < 8; k++) {
        values[k] = _mm256_loadu_ps(x + 8 * k);
        top = _mm256_max_epu32(top, _mm256_and_si256(_mm256_castps_si256(values[k]), magnitude));
    }
    __m128i half = _mm_max_epu32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    half = _mm_max_epu32(half, _mm_shuffle_epi32(half, 0x4e));
    half = _mm_max_epu32(half, _mm_shuffle_epi32(half, 0xb1));
    float scale = scale_of((uint32_t)_mm_cvtsi128_si32(half), step);
    if (codes_are_zero(scale)) {
        memset(codes, 0, BLOCK);
        return scale;
    }
    const __m256 divisor = _mm256_set1_ps(scale);
    /* The packs interleave 128-bit lanes; this puts each vector's eight codes back in order. */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int k = 0; k < 8; k += 4) {
        __m256i ints[4];
        for (int j = 0; j < 4; j++) {
            __m256 level = _mm256_add_ps(_mm256_loadu_ps(noise + 8 * (k + j)),
                                         _mm256_div_ps(values[k + j], divisor));
            ints[j] = _mm256_cvttps_epi32(_mm256_floor_ps(level));
        }
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                            _mm256_packs_epi32(ints[2], ints[3]));
        _mm256_storeu_si256((__m256i *)(codes + 8 * k),
                            _mm256_permutevar8x32_epi32(packed, order));
    }
    return scale;
}
#endif

/* Codes and scales of blocks [first_block, stop_block). */
static void encode_blocks(const Work *w) {
    /* The block's noise window and its place in it, advanced without a divide per block. */
    Py_ssize_t window = w->first_block * BLOCK / w->chunk;
    Py_ssize_t offset = w->first_block * BLOCK % w->chunk;
    for (Py_ssize_t b = w->first_block; b < w->stop_block; b++) {
        Py_ssize_t start = b * BLOCK;
        Py_ssize_t len = w->count - start < BLOCK ? w->count - start : BLOCK;
        const float *noise = w->windows[window] + offset;
        offset += BLOCK;
        if (offset == w->chunk) {
            window++;
            offset = 0;
        }
#ifdef HAVE_AVX2_PATH
        if (use_avx2 && len == BLOCK) {
            w->scales[b] = encode_block_avx2(w->x + start, noise, w->codes + start, w->step);
            continue;
        }
#endif
        w->scales[b] = encode_block(w->x + start, noise, w->codes + start, len, w->step);
    }
}

static void decode_blocks(const Work *w) {
    for (Py_ssize_t b = w->first_block; b < w->stop_block; b++) {
        Py_ssize_t start = b * BLOCK;
        Py_ssize_t len = w->count - start < BLOCK ? w->count - start : BLOCK;
        const int8_t *codes = w->codes + start;
        float *out = w->out + start;
        float scale = w->scales[b];
        if (len == BLOCK) { /* a constant trip count: vectorised whole */
            for (int i = 0; i < BLOCK; i++) {
                out[i] = (float)codes[i] * scale;
            }
            continue;
        }
        for (Py_ssize_t i = 0; i < len; i++) {
            out[i] = (float)codes[i] * scale;
        }
    }
}

typedef void (*BlockFn)(const Work *);

typedef struct {
    BlockFn fn;
    Work work;
} Task;

#ifndef _WIN32
static void *run_task(void *arg) {
    Task *task = (Task *)arg;
    task->fn(&task->work);
    return NULL;
}
#endif

/* Runs `fn` over all blocks of `work`, split into `threads` contiguous ranges: the calling
 * thread takes the first, and returns once every range is done (pthread_join). Falls back
 * to the calling thread alone where a thread cannot start. */
static void run_blocks(BlockFn fn, const Work *work, int threads) {
    Py_ssize_t blocks = (work->count + BLOCK - 1) / BLOCK;
    if (threads > MAX_THREADS) {
        threads = MAX_THREADS;
    }
    if (threads < 2 || work->count < MIN_PARALLEL) {
        threads = 1;
    }
#ifdef _WIN32
    threads = 1;
#endif
    Task tasks[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        tasks[t].fn = fn;
        tasks[t].work = *work;
        tasks[t].work.first_block = blocks * t / threads;
        tasks[t].work.stop_block = blocks * (t + 1) / threads;
    }
#ifndef _WIN32
    pthread_t handles[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&handles[t], NULL, run_task, &tasks[t]) == 0;
    }
    fn(&tasks[0].work);
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(handles[t], NULL);
        } else {
            fn(&tasks[t].work);
        }
    }
#else
    fn(&tasks[0].work);
#endif
}

static PyObject *encode(PyObject *self, PyObject *args) {
    unsigned long long x, codes, scales;
    PyObject *windows;
    Py_ssize_t count, chunk;
    float step;
    int threads;
    if (!PyArg_ParseTuple(args, "KnOnKKfi", &x, &count, &windows, &chunk, &codes, &scales,
                          &step, &threads)) {
        return NULL;
    }
    if (count < 0 || chunk <= 0 || chunk % BLOCK != 0) {
        PyErr_Format(PyExc_ValueError,
                     "encode: count %zd must be >= 0 and chunk %zd a positive multiple of %d",
                     count, chunk, BLOCK);
        return NULL;
    }
    PyObject *sequence = PySequence_Fast(windows, "encode: windows must be a sequence");
    if (sequence == NULL) {
        return NULL;
    }
    /* One window per chunk of the padded entries: fewer would send blocks past the end. */
    Py_ssize_t needed = ((count + BLOCK - 1) / BLOCK * BLOCK + chunk - 1) / chunk;
    Py_ssize_t given = PySequence_Fast_GET_SIZE(sequence);
    if (given < needed) {
        PyErr_Format(PyExc_ValueError, "encode: %zd noise windows for %zd chunks", given,
                     needed);
        Py_DECREF(sequence);
        return NULL;
    }
    const float **addresses = PyMem_Malloc((given > 0 ? given : 1) * sizeof *addresses);
    if (addresses == NULL) {
        Py_DECREF(sequence);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < given; i++) {
        addresses[i] = (const float *)(uintptr_t)PyLong_AsUnsignedLongLong(
            PySequence_Fast_GET_ITEM(sequence, i));
    }
    Py_DECREF(sequence);
    if (PyErr_Occurred()) {
        PyMem_Free(addresses);
        return NULL;
    }
    Work work = {
        .x = (const float *)(uintptr_t)x,
        .windows = addresses,
        .codes = (int8_t *)(uintptr_t)codes,
        .scales = (float *)(uintptr_t)scales,
        .count = count,
        .chunk = chunk,
        .step = step,
    };
    Py_BEGIN_ALLOW_THREADS
    run_blocks(encode_blocks, &work, threads);
    Py_END_ALLOW_THREADS
    PyMem_Free(addresses);
    Py_RETURN_NONE;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long codes, scales, out;
    Py_ssize_t count;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKni", &codes, &scales, &out, &count, &threads)) {
        return NULL;
    }
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "decode: count %zd must be >= 0", count);
        return NULL;
    }
    Work work = {
        .codes = (int8_t *)(uintptr_t)codes,
        .scales = (float *)(uintptr_t)scales,
        .out = (float *)(uintptr_t)out,
        .count = count,
    };
    Py_BEGIN_ALLOW_THREADS
    run_blocks(decode_blocks, &work, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *set_avx2(PyObject *self, PyObject *args) {
    int enabled;
    if (!PyArg_ParseTuple(args, "p", &enabled)) {
        return NULL;
    }
    int previous = use_avx2;
    use_avx2 = enabled && avx2_supported;
    return PyBool_FromLong(previous);
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(x, count, windows, chunk, codes, scales, step, threads): int8 codes and fp32 "
     "scales of `count` fp32 entries at address x; windows: a sequence of one noise "
     "window's address per chunk."},
    {"decode", decode, METH_VARARGS,
     "decode(codes, scales, out, count, threads): `count` fp32 entries at address out."},
    {"use_avx2", set_avx2, METH_VARARGS,
     "use_avx2(enabled): whole blocks through AVX2 (where the CPU has it) or the portable "
     "loops; returns the previous setting."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_int8_cpu", "The int8 block codec's one-pass CPU kernels.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__int8_cpu(void) {
#ifdef HAVE_AVX2_PATH
    avx2_supported = __builtin_cpu_supports("avx2") != 0;
#endif
    use_avx2 = avx2_supported;
    PyObject *self = PyModule_Create(&module);
    if (self != NULL && PyModule_AddIntConstant(self, "MIN_PARALLEL", MIN_PARALLEL) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return self;
}
