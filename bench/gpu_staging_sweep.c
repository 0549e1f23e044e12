// GPU staging sweep: the one-off C diagnostic behind the ring-size and page-locking figures in
// BENCHMARKS.md ("GPU hydration"), kept as it ran. On the GPU host, with FILE in the page cache:
//
//     gcc -O2 -pthread bench/gpu_staging_sweep.c -ldl -o /tmp/gpu_staging_sweep
//     /tmp/gpu_staging_sweep FILE
//
// Prints, each against a pinned 1 GiB host->device copy of the same run:
//  * "pread ... T<threads> chunk <KiB> slots <n>": threads pread chunks of FILE into their own
//    ring of cuMemHostAlloc'ed slots and cuMemcpyHtoDAsync them (what native/fill.c does), for
//    8/12/16 threads x 512 KiB..8 MiB chunks x 2/4 slots (evblk: blocking-sync events);
//  * "register piece ...": page-locking the mapped FILE in place piece by piece
//    (cuMemHostRegister READ_ONLY) by 1-8 threads, each piece DMA'd once registered;
//  * "register_whole": the whole mapped FILE registered at once, then one DMA.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUctx;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdptr;

static CUresult (*pInit)(unsigned);
static CUresult (*pDeviceGet)(int *, int);
static CUresult (*pPrimaryRetain)(CUctx *, int);
static CUresult (*pCtxSet)(CUctx);
static CUresult (*pMemAlloc)(CUdptr *, size_t);
static CUresult (*pHostAlloc)(void **, size_t, unsigned);
static CUresult (*pFreeHost)(void *);
static CUresult (*pHostRegister)(void *, size_t, unsigned);
static CUresult (*pHostUnregister)(void *);
static CUresult (*pStreamCreate)(CUstream *, unsigned);
static CUresult (*pStreamSync)(CUstream);
static CUresult (*pEventCreate)(CUevent *, unsigned);
static CUresult (*pEventRecord)(CUevent, CUstream);
static CUresult (*pEventSync)(CUevent);
static CUresult (*pH2DAsync)(CUdptr, const void *, size_t, CUstream);

#define CK(x) do { CUresult _r = (x); if (_r) { fprintf(stderr, "%s -> %d line %d\n", #x, _r, __LINE__); exit(1); } } while (0)

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static CUctx ctx;
static CUdptr dbase;
static int fd;
static size_t fsize;
static char *fmap;

struct cfg { int threads; size_t chunk; int slots; int mode; unsigned evflags; };
static struct cfg C;
static atomic_size_t next_off;

static void *pool[64][4];
static CUstream pstream[64];
static CUevent pev[64][4];
static void *worker(void *arg) {
    long tid = (long)arg;
    CK(pCtxSet(ctx));
    CUstream s = pstream[tid];
    void **buf = pool[tid];
    CUevent *ev = pev[tid];
    int used[4] = {0, 0, 0, 0};
    for (unsigned k = 0;; k++) {
        size_t off = atomic_fetch_add(&next_off, C.chunk);
        if (off >= fsize) break;
        size_t n = fsize - off < C.chunk ? fsize - off : C.chunk;
        int sl = k % C.slots;
        if (used[sl]) CK(pEventSync(ev[sl]));
        if (C.mode == 0) {
            size_t got = 0;
            while (got < n) { ssize_t r = pread(fd, (char *)buf[sl] + got, n - got, off + got); if (r <= 0) { perror("pread"); exit(1); } got += r; }
        } else {
            memcpy(buf[sl], fmap + off, n);
        }
        CK(pH2DAsync(dbase + off, buf[sl], n, s));
        CK(pEventRecord(ev[sl], s));
        used[sl] = 1;
    }
    CK(pStreamSync(s));
    return NULL;
}

static double run(struct cfg c) {
    C = c;
    atomic_store(&next_off, 0);
    pthread_t th[64];
    double t0 = now();
    for (long i = 0; i < c.threads; i++) pthread_create(&th[i], NULL, worker, (void *)i);
    for (int i = 0; i < c.threads; i++) pthread_join(th[i], NULL);
    return now() - t0;
}


static char *rbase;
static size_t rpiece;
static atomic_size_t rnext;
static CUstream rs[16];
static void *regworker(void *arg) {
    long tid = (long)arg;
    CK(pCtxSet(ctx));
    for (;;) {
        size_t off = atomic_fetch_add(&rnext, rpiece);
        if (off >= fsize) break;
        size_t n = fsize - off < rpiece ? fsize - off : rpiece;
        CK(pHostRegister(rbase + off, n, 8));
        CK(pH2DAsync(dbase + off, rbase + off, n, rs[tid]));
    }
    CK(pStreamSync(rs[tid]));
    return NULL;
}
static void regexp(double pinned) {
    size_t pieces[] = {32 << 20, 128 << 20, 512 << 20};
    int tr[] = {1, 2, 4, 8};
    for (int i = 0; i < 16; i++) CK(pStreamCreate(&rs[i], 1));
    for (int pi = 0; pi < 3; pi++) for (int ti = 0; ti < 4; ti++) for (int pop = 0; pop < 2; pop++) {
        double bd = 1e9, be = 1e9;
        for (int r = 0; r < 3; r++) {
            double t0 = now();
            rbase = mmap(NULL, fsize, PROT_READ, MAP_SHARED | (pop ? MAP_POPULATE : 0), fd, 0);
            rpiece = pieces[pi];
            atomic_store(&rnext, 0);
            pthread_t th[16];
            for (long i = 0; i < tr[ti]; i++) pthread_create(&th[i], NULL, regworker, (void *)i);
            for (int i = 0; i < tr[ti]; i++) pthread_join(th[i], NULL);
            double td = now() - t0;
            for (size_t off = 0; off < fsize; off += rpiece) CK(pHostUnregister(rbase + off));
            munmap(rbase, fsize);
            double te = now() - t0;
            if (td < bd) bd = td;
            if (te < be) be = te;
        }
        printf("register piece %4zuM TR %d populate %d : dma-done %.3f s %.2f GB/s ratio %.3f | with unregister+munmap %.3f s ratio %.3f\n",
               pieces[pi] >> 20, tr[ti], pop, bd, fsize / bd / 1e9, fsize / bd / 1e9 / pinned, be, fsize / be / 1e9 / pinned);
        fflush(stdout);
    }
}

int main(int argc, char **argv) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
#define L(p, n) *(void **)&p = dlsym(h, n); if (!p) { fprintf(stderr, "no %s\n", n); return 1; }
    L(pInit, "cuInit"); L(pDeviceGet, "cuDeviceGet"); L(pPrimaryRetain, "cuDevicePrimaryCtxRetain");
    L(pCtxSet, "cuCtxSetCurrent"); L(pMemAlloc, "cuMemAlloc_v2"); L(pHostAlloc, "cuMemHostAlloc");
    L(pFreeHost, "cuMemFreeHost"); L(pHostRegister, "cuMemHostRegister_v2"); L(pHostUnregister, "cuMemHostUnregister");
    L(pStreamCreate, "cuStreamCreate"); L(pStreamSync, "cuStreamSynchronize"); L(pEventCreate, "cuEventCreate");
    L(pEventRecord, "cuEventRecord"); L(pEventSync, "cuEventSynchronize"); L(pH2DAsync, "cuMemcpyHtoDAsync_v2");
    int dev; CK(pInit(0)); CK(pDeviceGet(&dev, 0)); CK(pPrimaryRetain(&ctx, dev)); CK(pCtxSet(ctx));
    fd = open(argv[1], O_RDONLY);
    struct stat st; fstat(fd, &st); fsize = st.st_size;
    fmap = mmap(NULL, fsize, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    CK(pMemAlloc(&dbase, fsize));
    // baseline: pinned 1 GiB -> device, best of 5
    size_t bl = 1ul << 30; void *pin; CK(pHostAlloc(&pin, bl, 0)); memset(pin, 1, bl);
    CUstream s0; CK(pStreamCreate(&s0, 1));
    double best = 1e9;
    for (int i = 0; i < 6; i++) { double t0 = now(); CK(pH2DAsync(dbase, pin, bl, s0)); CK(pStreamSync(s0)); double t = now() - t0; if (i && t < best) best = t; }
    double pinned = bl / best / 1e9;
    printf("pinned_h2d %.2f GB/s\n", pinned);
    int threads[] = {8, 12, 16};
    size_t chunks[] = {512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20};
    int slots[] = {2, 4};
    const char *only = getenv("ONLY");
    for (int mode = 0; mode < 1; mode++)
    for (int ei = 0; ei < 2; ei++)
    for (int ti = 0; ti < 3; ti++)
    for (int ci = 0; ci < 5; ci++)
    for (int si = 0; si < 2; si++) {
        struct cfg c = {threads[ti], chunks[ci], slots[si], mode, ei ? 1 /*BLOCKING_SYNC*/ : 0};
        if (only && atoi(only) != mode) continue;
        if (ei && (ci != 2)) continue;  // blocking events only at 2 MiB
        for (int t = 0; t < c.threads; t++) { CK(pStreamCreate(&pstream[t], 1)); for (int i = 0; i < c.slots; i++) { CK(pHostAlloc(&pool[t][i], c.chunk, 0)); CK(pEventCreate(&pev[t][i], c.evflags)); } }
        run(c);
        double b = 1e9;
        for (int r = 0; r < 3; r++) { double t = run(c); if (t < b) b = t; }
        double g = fsize / b / 1e9;
        printf("%s ev%s T%2d chunk %5zuK slots %d : %6.2f GB/s  ratio %.3f\n", mode ? "mmap " : "pread", ei ? "blk" : "spn",
               c.threads, c.chunk >> 10, c.slots, g, g / pinned);
        fflush(stdout);
        for (int t = 0; t < c.threads; t++) for (int i = 0; i < c.slots; i++) pFreeHost(pool[t][i]);
    }
    regexp(pinned);
    // register strategy: whole-file register once, then DMA
    double t0 = now();
    CUresult r = pHostRegister(fmap, fsize, 8 /*READ_ONLY*/);
    double treg = now() - t0;
    if (!r) {
        double b2 = 1e9;
        for (int i = 0; i < 3; i++) { double t1 = now(); CK(pH2DAsync(dbase, fmap, fsize, s0)); CK(pStreamSync(s0)); double t = now() - t1; if (t < b2) b2 = t; }
        printf("register_whole %.3f s (%.2f GB/s incl), dma from registered page cache %.2f GB/s ratio %.3f\n", treg,
               fsize / (treg + b2) / 1e9, fsize / b2 / 1e9, fsize / b2 / 1e9 / pinned);
        pHostUnregister(fmap);
    } else printf("register failed %d\n", r);
    return 0;
}
