/* ColdSnap native fill: file bytes -> page-locked staging -> device memory, without the GIL.
 *
 * Copyright: ColdSnap contributors. SPDX-License-Identifier: Apache-2.0
 *
 * The Python side (plugins/module_utils/payload/native_fill.py: Plan, NativeLanes; used by
 * CudaSink in cuda.py) cuts a hydration into groups: each group is a list of file pieces
 * whose destination bytes are contiguous and at most one chunk long. Here a pool of threads claims groups in order; each thread owns one
 * CUDA stream and a ring of small page-locked slots. A thread reads a group's pieces into its
 * next slot (pread, straight from the page cache), queues one cuMemcpyHtoDAsync of the slot,
 * records the slot's event, and moves on; before it refills a slot it waits for that slot's
 * event. The ring is kept small (threads x slots x chunk, e.g. 12 x 2 x 4 MiB) so the staging
 * stays in the CPU's last-level cache: the copy engine then reads the slots from the cache,
 * and host memory carries each byte about once instead of three times.
 *
 * Hashed fills (recovery: every extent must match the SHA-256 recorded at capture) give each
 * thread whole extents and hash each slot before its copy is queued, with libcrypto.
 *
 * With no CUDA context (ctx == NULL) the same pipeline copies each slot into host memory
 * with memcpy: that is how the pipeline is tested on machines without a GPU.
 *
 * libcuda is opened at run time (dlopen), so building this needs only a C compiler.
 * The ABI is plain C for ctypes: see struct cs_piece and the cs_* functions below.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef CS_ABI
#define CS_ABI 4
#endif
#define CS_MAX_THREADS 64
#define CS_MAX_SLOTS 8

/* Error kinds reported to Python (struct cs_error.kind). */
enum { CS_OK = 0, CS_SHORT_READ = 1, CS_READ_ERRNO = 2, CS_CUDA = 3, CS_NOMEM = 4, CS_ARGS = 5, CS_CRYPTO = 6 };

struct cs_piece {       /* `size` bytes of file `fd` at `offset`, for destination byte `dst` */
    int64_t fd;
    uint64_t offset;
    uint64_t size;
    uint64_t dst;
};

struct cs_error {       /* the first failure of a fill */
    int32_t kind;
    int32_t code;       /* errno, or the CUresult */
    int64_t piece;      /* index into the pieces array, or -1 */
    uint64_t at;        /* file offset reached (short read) */
    char call[48];      /* the CUDA call that failed */
};

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

static struct {
    CUresult (*ctx_set)(CUcontext);
    CUresult (*host_register)(void *, size_t, unsigned);
    CUresult (*host_unregister)(void *);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_sync)(CUstream);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*event_create)(CUevent *, unsigned);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_sync)(CUevent);
    CUresult (*event_destroy)(CUevent);
    CUresult (*h2d_async)(CUdeviceptr, const void *, size_t, CUstream);
} cu;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_loaded;

/* Resolve `name` in library `h` into the function pointer `field`; return from the loader if absent. */
#define SYM(field, name) if (!(*(void **)&(field) = dlsym(h, name))) return

static void cu_load(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return;
    SYM(cu.ctx_set, "cuCtxSetCurrent");
    SYM(cu.host_register, "cuMemHostRegister_v2");
    SYM(cu.host_unregister, "cuMemHostUnregister");
    SYM(cu.stream_create, "cuStreamCreate");
    SYM(cu.stream_sync, "cuStreamSynchronize");
    SYM(cu.stream_destroy, "cuStreamDestroy_v2");
    SYM(cu.event_create, "cuEventCreate");
    SYM(cu.event_record, "cuEventRecord");
    SYM(cu.event_sync, "cuEventSynchronize");
    SYM(cu.event_destroy, "cuEventDestroy_v2");
    SYM(cu.h2d_async, "cuMemcpyHtoDAsync_v2");
    cu_loaded = 1;
}

/* SHA-256 for hashed fills (recovery checks every extent against the digest recorded at
 * capture): OpenSSL's libcrypto, the library Python's hashlib uses, opened at run time. */
static struct {
    void *(*ctx_new)(void);
    void (*ctx_free)(void *);
    const void *(*sha256)(void);
    int (*init)(void *, const void *, void *);
    int (*update)(void *, const void *, size_t);
    int (*final)(void *, unsigned char *, unsigned int *);
} crypto;
static pthread_once_t crypto_once = PTHREAD_ONCE_INIT;
static int crypto_loaded;

static void crypto_load(void) {
    void *h = dlopen("libcrypto.so.3", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        h = dlopen("libcrypto.so", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return;
    SYM(crypto.ctx_new, "EVP_MD_CTX_new");
    SYM(crypto.ctx_free, "EVP_MD_CTX_free");
    SYM(crypto.sha256, "EVP_sha256");
    SYM(crypto.init, "EVP_DigestInit_ex");
    SYM(crypto.update, "EVP_DigestUpdate");
    SYM(crypto.final, "EVP_DigestFinal_ex");
    crypto_loaded = 1;
}

/* 1 when hashed fills are available (libcrypto found), else 0. */
int cs_sha256_available(void) {
    pthread_once(&crypto_once, crypto_load);
    return crypto_loaded;
}

struct lane {           /* one thread's resources, created by that thread on first use */
    CUstream stream;
    void *slot[CS_MAX_SLOTS];
    void *map[CS_MAX_SLOTS];        /* device mode: the mapping a slot lies in, and its length */
    size_t map_len[CS_MAX_SLOTS];
    CUevent event[CS_MAX_SLOTS];
    int busy[CS_MAX_SLOTS];
    unsigned next;
};

struct cs_sink;

struct fill {           /* one cs_fill call (or one staging), shared by its threads */
    struct cs_sink *sink;
    const struct cs_piece *pieces;
    const uint64_t *groups;     /* group g = pieces[groups[g], groups[g + 1]) */
    uint64_t ngroups;
    unsigned char *digests;     /* hashed fill: SHA-256 of group g at digests[32 g]; else NULL */
    atomic_uint_fast64_t next_group;
    volatile uint64_t *done;    /* bytes copied so far, for progress; may be NULL */
    atomic_int failed;
    pthread_mutex_t lock;
    struct cs_error err;
};

struct worker_arg {
    struct fill *f;
    int index;
};

struct cs_sink {
    CUcontext ctx;      /* NULL: host mode */
    int threads, slots;
    uint64_t chunk;
    struct lane lane[CS_MAX_THREADS];
    /* Staging started ahead of a fill (cs_sink_stage_start): staging[i] stays set while lane i's
     * stager works on it, and a fill's thread i waits for its own lane only, so the fill starts
     * on the lanes that are ready while the others are still being page-locked. */
    pthread_mutex_t stage_lock;
    pthread_cond_t stage_cond;
    int staging[CS_MAX_THREADS];
    int stage_running, stage_launched;
    pthread_t stage_launcher;           /* runs the stagers, off the caller's path */
    struct fill stage;          /* the stagers' shared state: their first failure */
    uint64_t stage_end_ns;      /* CLOCK_MONOTONIC when the last stager was done */
};

int cs_abi(void) { return CS_ABI; }

static int fail(struct fill *f, int kind, int code, int64_t piece, uint64_t at, const char *call) {
    pthread_mutex_lock(&f->lock);
    if (!atomic_load(&f->failed)) {
        f->err.kind = kind;
        f->err.code = code;
        f->err.piece = piece;
        f->err.at = at;
        snprintf(f->err.call, sizeof f->err.call, "%s", call ? call : "");
        atomic_store(&f->failed, 1);
    }
    pthread_mutex_unlock(&f->lock);
    return -1;
}

#define CU(f, expr, name) do { CUresult r_ = (expr); if (r_) return fail((f), CS_CUDA, r_, -1, 0, (name)); } while (0)

#define HUGE_PAGE (2u << 20)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* A page-locked slot: anonymous memory on 2 MiB boundaries, advised to use transparent huge
 * pages, faulted in, then registered with the driver. Page-locking costs per page, so with
 * huge pages this is ~3x faster than cuMemHostAlloc (which maps 4 KiB pages and serializes
 * across threads), and a restore page-locks its staging afresh (BENCHMARKS.md). */
static int pin_slot(struct fill *f, struct lane *l, unsigned k) {
    size_t size = f->sink->chunk, len = size + HUGE_PAGE;
    char *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED)
        return fail(f, CS_NOMEM, errno, -1, 0, "mmap");
    l->map[k] = map;
    l->map_len[k] = len;
    char *p = (char *)(((uintptr_t)map + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    madvise(p, size, MADV_HUGEPAGE);                /* a no-op where THP is off */
    if (madvise(p, size, MADV_POPULATE_WRITE))      /* Linux < 5.14: touch it instead */
        memset(p, 0, size);
    CUresult r = cu.host_register(p, size, 0);
    if (r) {
        munmap(map, len);
        l->map[k] = NULL;
        return fail(f, CS_CUDA, r, -1, 0, "cuMemHostRegister");
    }
    l->slot[k] = p;
    return 0;
}

/* Each thread page-locks its own slots, one at a time as it first needs them, so the lanes
 * allocate in parallel and a slot's allocation overlaps the copy of the slot before it.
 * Whatever was allocated stays recorded in the lane (also after a failure) and is freed by
 * cs_sink_free. */
static int lane_slot(struct fill *f, struct lane *l, unsigned k) {
    struct cs_sink *s = f->sink;
    if (s->ctx && !l->stream)
        CU(f, cu.stream_create(&l->stream, 1 /* CU_STREAM_NON_BLOCKING */), "cuStreamCreate");
    if (!l->slot[k]) {
        if (s->ctx) {
            if (pin_slot(f, l, k))
                return -1;
        } else if (!(l->slot[k] = malloc(s->chunk))) {
            return fail(f, CS_NOMEM, ENOMEM, -1, 0, "malloc");
        }
    }
    if (s->ctx && !l->event[k])
        CU(f, cu.event_create(&l->event[k], 2 /* CU_EVENT_DISABLE_TIMING */), "cuEventCreate");
    return 0;
}

/* `len` bytes of piece `index`, from `pos` bytes into it. */
static int read_range(struct fill *f, uint64_t index, uint64_t pos, uint64_t len, char *into) {
    const struct cs_piece *p = &f->pieces[index];
    uint64_t got = 0;
    while (got < len) {
        ssize_t n = pread((int)p->fd, into + got, len - got, (off_t)(p->offset + pos + got));
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return fail(f, CS_READ_ERRNO, errno, (int64_t)index, p->offset + pos + got, "pread");
        }
        if (n == 0)
            return fail(f, CS_SHORT_READ, 0, (int64_t)index, p->offset + pos + got, "pread");
        got += (uint64_t)n;
    }
    return 0;
}

static int stopping(struct fill *f) {
    return atomic_load(&f->failed);
}

/* Stream one unit (pieces[first, last), contiguous destination) through the lane's ring:
 * fill a slot from the pieces, hash it (hashed fills), queue its copy, move to the next slot. */
static int copy_unit(struct fill *f, struct lane *l, uint64_t first, uint64_t last, void *md) {
    struct cs_sink *s = f->sink;
    if (first == last)                              /* an empty extent: nothing to copy, hash "" */
        return 0;
    CUdeviceptr dst = f->pieces[first].dst;
    uint64_t i = first, pos = 0;                    /* the next byte: `pos` into piece i */
    while (i < last) {
        unsigned k = l->next;
        l->next = (k + 1) % (unsigned)s->slots;
        if (lane_slot(f, l, k))
            return -1;
        if (s->ctx && l->busy[k]) {
            CUresult r = cu.event_sync(l->event[k]);     /* the slot's last copy is done */
            if (r)
                return fail(f, CS_CUDA, r, -1, 0, "cuEventSynchronize");
        }
        char *buf = l->slot[k];
        uint64_t used = 0;
        while (i < last && used < s->chunk) {
            uint64_t left = f->pieces[i].size - pos, take = left < s->chunk - used ? left : s->chunk - used;
            if (read_range(f, i, pos, take, buf + used))
                return -1;
            used += take;
            pos += take;
            if (pos == f->pieces[i].size) {
                i++;
                pos = 0;
            }
            if (stopping(f))
                return -1;
        }
        if (md && !crypto.update(md, buf, used))
            return fail(f, CS_CRYPTO, 0, (int64_t)first, 0, "EVP_DigestUpdate");
        if (s->ctx) {
            CUresult r = cu.h2d_async(dst, buf, used, l->stream);
            if (!r)
                r = cu.event_record(l->event[k], l->stream);
            if (r)
                return fail(f, CS_CUDA, r, (int64_t)first, 0, "cuMemcpyHtoDAsync");
            l->busy[k] = 1;
        } else {
            memcpy((void *)(uintptr_t)dst, buf, used);
        }
        dst += used;
        if (f->done)
            __atomic_fetch_add(f->done, used, __ATOMIC_RELAXED);
    }
    return 0;
}

static void *worker(void *argp) {
    struct worker_arg *arg = argp;
    struct fill *f = arg->f;
    struct cs_sink *s = f->sink;
    struct lane *l = &s->lane[arg->index];
    void *md = NULL;
    pthread_mutex_lock(&s->stage_lock);             /* staging ahead (if any) is done with this lane */
    while (s->staging[arg->index])
        pthread_cond_wait(&s->stage_cond, &s->stage_lock);
    pthread_mutex_unlock(&s->stage_lock);
    if (s->ctx && cu.ctx_set(s->ctx)) {
        fail(f, CS_CUDA, 0, -1, 0, "cuCtxSetCurrent");
        return NULL;
    }
    if (f->digests && !(md = crypto.ctx_new())) {
        fail(f, CS_NOMEM, ENOMEM, -1, 0, "EVP_MD_CTX_new");
        return NULL;
    }
    for (;;) {
        if (stopping(f))
            break;
        uint64_t g = atomic_fetch_add(&f->next_group, 1);
        if (g >= f->ngroups)
            break;
        if (md && !crypto.init(md, crypto.sha256(), NULL)) {
            fail(f, CS_CRYPTO, 0, (int64_t)f->groups[g], 0, "EVP_DigestInit_ex");
            break;
        }
        if (copy_unit(f, l, f->groups[g], f->groups[g + 1], md))
            break;
        if (md && !crypto.final(md, f->digests + 32 * g, NULL)) {
            fail(f, CS_CRYPTO, 0, (int64_t)f->groups[g], 0, "EVP_DigestFinal_ex");
            break;
        }
    }
    if (md)
        crypto.ctx_free(md);
    if (s->ctx && l->stream) {
        CUresult r = cu.stream_sync(l->stream);  /* every queued copy of this fill has landed */
        if (r)
            fail(f, CS_CUDA, r, -1, 0, "cuStreamSynchronize");
        for (int i = 0; i < s->slots; i++)
            l->busy[i] = 0;
    }
    return NULL;
}

/* Lane i is the fill's again (whatever its stager got done: a fill's thread allocates what is
 * missing itself, and reports that failure if it recurs). */
static void lane_staged(struct cs_sink *s, int i) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    uint64_t ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    pthread_mutex_lock(&s->stage_lock);
    s->staging[i] = 0;
    if (ns > s->stage_end_ns)
        s->stage_end_ns = ns;
    pthread_cond_broadcast(&s->stage_cond);
    pthread_mutex_unlock(&s->stage_lock);
}

static void *stager(void *argp) {
    struct worker_arg *arg = argp;
    struct fill *f = arg->f;
    struct cs_sink *s = f->sink;
    if (s->ctx && cu.ctx_set(s->ctx))
        fail(f, CS_CUDA, 0, -1, 0, "cuCtxSetCurrent");
    else
        for (int k = 0; k < s->slots && !stopping(f); k++)
            if (lane_slot(f, &s->lane[arg->index], (unsigned)k))
                break;
    lane_staged(s, arg->index);
    return NULL;
}

/* Start n threads running `fn` over one fill's (or staging's) state; join them; 0, or -1 with f->err set. */
static int run_threads(struct fill *f, int n, void *(*fn)(void *)) {
    pthread_t tid[CS_MAX_THREADS];
    struct worker_arg args[CS_MAX_THREADS];
    int started = 0;
    for (int i = 0; i < n; i++) {
        args[i].f = f;
        args[i].index = i;
        if (pthread_create(&tid[i], NULL, fn, &args[i])) {
            fail(f, CS_NOMEM, errno, -1, 0, "pthread_create");
            break;
        }
        started++;
    }
    for (int i = 0; i < started; i++)
        pthread_join(tid[i], NULL);
    return atomic_load(&f->failed) ? -1 : 0;
}

/* Every lane left to the fill: those whose stager never ran allocate their own staging. */
static void release_lanes(struct cs_sink *s) {
    pthread_mutex_lock(&s->stage_lock);
    for (int i = 0; i < s->threads; i++)
        s->staging[i] = 0;
    pthread_cond_broadcast(&s->stage_cond);
    pthread_mutex_unlock(&s->stage_lock);
}

/* The staging's first thread: runs one stager per lane (thread creation competes with the
 * stagers' page faults for the address space, so it is kept off the caller). */
static void *stage_launch(void *argp) {
    struct cs_sink *s = argp;
    run_threads(&s->stage, s->threads, stager);
    release_lanes(s);
    return NULL;
}

/* Start page-locking every lane's staging (and creating its stream and events), one thread
 * per lane, and return at once: a restore calls this while it still checks the payload. A fill
 * may start before the staging is done; each of its threads waits for its own lane only.
 * cs_sink_stage_wait joins the stagers. Whatever they allocate stays in the sink (also after a
 * failure) and cs_sink_free frees it. A second call while staging runs does nothing. */
void cs_sink_stage_start(struct cs_sink *s) {
    if (s->stage_running)
        return;
    memset(&s->stage, 0, sizeof s->stage);
    s->stage.sink = s;
    s->stage.err.piece = -1;
    pthread_mutex_init(&s->stage.lock, NULL);
    s->stage_end_ns = 0;
    pthread_mutex_lock(&s->stage_lock);
    for (int i = 0; i < s->threads; i++)
        s->staging[i] = 1;
    pthread_mutex_unlock(&s->stage_lock);
    s->stage_running = 1;
    s->stage_launched = !pthread_create(&s->stage_launcher, NULL, stage_launch, s);
    if (!s->stage_launched) {
        fail(&s->stage, CS_NOMEM, errno, -1, 0, "pthread_create");
        release_lanes(s);
    }
}

/* Join the stagers of cs_sink_stage_start (if any). Returns 0, or -1 with *err set to their first
 * failure; *end_ns (may be NULL) gets the CLOCK_MONOTONIC time the staging ended (0: none ran). */
int cs_sink_stage_wait(struct cs_sink *s, struct cs_error *err, uint64_t *end_ns) {
    memset(err, 0, sizeof *err);
    err->piece = -1;
    if (end_ns)
        *end_ns = 0;
    if (!s->stage_running)
        return 0;
    if (s->stage_launched)
        pthread_join(s->stage_launcher, NULL);
    int rc = atomic_load(&s->stage.failed) ? -1 : 0;
    if (rc)
        *err = s->stage.err;
    if (end_ns)
        *end_ns = s->stage_end_ns;
    pthread_mutex_destroy(&s->stage.lock);
    s->stage_running = 0;
    s->stage_launched = 0;
    return rc;
}

/* A sink: `threads` lanes of `slots` x `chunk` bytes of staging, on `ctx` (NULL: host mode).
 * Returns NULL with *err set when the arguments are out of range or libcuda cannot be loaded. */
struct cs_sink *cs_sink_new(void *ctx, int threads, int slots, uint64_t chunk, struct cs_error *err) {
    memset(err, 0, sizeof *err);
    err->piece = -1;
    if (threads < 1 || threads > CS_MAX_THREADS || slots < 1 || slots > CS_MAX_SLOTS || chunk < 4096) {
        err->kind = CS_ARGS;
        snprintf(err->call, sizeof err->call, "threads/slots/chunk out of range");
        return NULL;
    }
    if (ctx) {
        pthread_once(&cu_once, cu_load);
        if (!cu_loaded) {
            err->kind = CS_CUDA;
            snprintf(err->call, sizeof err->call, "dlopen(libcuda.so.1)");
            return NULL;
        }
    }
    struct cs_sink *s = calloc(1, sizeof *s);
    if (!s) {
        err->kind = CS_NOMEM;
        err->code = ENOMEM;
        return NULL;
    }
    s->ctx = ctx;
    pthread_mutex_init(&s->stage_lock, NULL);
    pthread_cond_init(&s->stage_cond, NULL);
    s->threads = threads;
    s->slots = slots;
    s->chunk = chunk;
    return s;
}

/* Copy every group: its pieces land one after another from the first piece's `dst` on.
 * With `digests` (32 bytes per group) each group is also hashed (SHA-256) as it is copied,
 * from the very bytes that are copied; without, a group should be at most one chunk, so the
 * threads share big extents. Returns 0, or -1 with *err describing the first failure (the
 * other threads stop at their next slot). Every copy queued before a failure has completed
 * when this returns, so the caller may free the sink or the destinations. */
int cs_fill(struct cs_sink *s, const struct cs_piece *pieces, const uint64_t *groups, uint64_t ngroups,
            unsigned char *digests, volatile uint64_t *done, struct cs_error *err) {
    struct fill f;
    memset(&f, 0, sizeof f);
    memset(err, 0, sizeof *err);
    f.sink = s;
    f.pieces = pieces;
    f.groups = groups;
    f.ngroups = ngroups;
    f.digests = digests;
    f.done = done;
    f.err.piece = -1;
    if (digests && !cs_sha256_available()) {
        err->kind = CS_CRYPTO;
        err->piece = -1;
        snprintf(err->call, sizeof err->call, "dlopen(libcrypto.so.3)");
        return -1;
    }
    pthread_mutex_init(&f.lock, NULL);
    int rc = run_threads(&f, ngroups < (uint64_t)s->threads ? (int)ngroups : s->threads, worker);
    pthread_mutex_destroy(&f.lock);
    if (rc)
        *err = f.err;
    return rc;
}

/* Wait for the staging ahead (if it still runs; every fill has synchronized), free the staging,
 * streams and events. */
void cs_sink_free(struct cs_sink *s) {
    if (!s)
        return;
    struct cs_error ignored;
    cs_sink_stage_wait(s, &ignored, NULL);  /* its failure is moot: everything is freed below */
    if (s->ctx)
        cu.ctx_set(s->ctx);
    for (int t = 0; t < CS_MAX_THREADS; t++) {
        struct lane *l = &s->lane[t];
        for (int i = 0; i < s->slots; i++) {
            if (s->ctx) {
                if (l->event[i])
                    cu.event_destroy(l->event[i]);
                if (l->slot[i])
                    cu.host_unregister(l->slot[i]);
                if (l->map[i])
                    munmap(l->map[i], l->map_len[i]);
            } else {
                free(l->slot[i]);
            }
        }
        if (s->ctx && l->stream)
            cu.stream_destroy(l->stream);
    }
    pthread_cond_destroy(&s->stage_cond);
    pthread_mutex_destroy(&s->stage_lock);
    free(s);
}
