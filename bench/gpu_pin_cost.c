// Page-locking cost: the one-off C diagnostic behind the staging figures in BENCHMARKS.md
// ("GPU hydration"), kept as it ran. On the GPU host:
//
//     gcc -O2 -pthread bench/gpu_pin_cost.c -ldl -o /tmp/gpu_pin_cost && /tmp/gpu_pin_cost
//
// Times page-locking 2 buffers of 1-64 MiB per thread, by 1 and 8 threads: cuMemHostAlloc
// ("hostalloc"), anonymous memory faulted in then cuMemHostRegister'ed ("reg-populate"), and
// the same advised to use transparent huge pages ("reg-thp", what native/fill.c does).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
typedef int CUresult; typedef void *CUctx;
static CUresult (*pInit)(unsigned), (*pDeviceGet)(int *, int), (*pRetain)(CUctx *, int), (*pSet)(CUctx),
    (*pHostAlloc)(void **, size_t, unsigned), (*pFreeHost)(void *), (*pReg)(void *, size_t, unsigned), (*pUnreg)(void *);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static CUctx ctx; static size_t SZ; static int N; static int MODE;
static void *w(void *a) { (void)a; pSet(ctx); void *p[8];
  for (int i = 0; i < N; i++) {
    if (MODE == 0) pHostAlloc(&p[i], SZ, 0);
    else if (MODE == 1) { p[i] = mmap(NULL, SZ, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE, -1, 0); pReg(p[i], SZ, 0); }
    else { p[i] = mmap(NULL, SZ, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0); madvise(p[i], SZ, MADV_HUGEPAGE); memset(p[i], 0, SZ); pReg(p[i], SZ, 0); }
  }
  return NULL; }
int main(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
#define L(p, n) *(void **)&p = dlsym(h, n)
  L(pInit, "cuInit"); L(pDeviceGet, "cuDeviceGet"); L(pRetain, "cuDevicePrimaryCtxRetain"); L(pSet, "cuCtxSetCurrent");
  L(pHostAlloc, "cuMemHostAlloc"); L(pFreeHost, "cuMemFreeHost"); L(pReg, "cuMemHostRegister_v2"); L(pUnreg, "cuMemHostUnregister");
  int d; pInit(0); pDeviceGet(&d, 0); pRetain(&ctx, d); pSet(ctx);
  size_t sizes[] = {1 << 20, 2 << 20, 4 << 20, 8 << 20, 64 << 20};
  for (int m = 0; m < 3; m++) for (int s = 0; s < 5; s++) for (int th = 1; th <= 8; th *= 8) {
    SZ = sizes[s]; N = 2; MODE = m;
    pthread_t t[8]; double t0 = now();
    for (int i = 0; i < th; i++) pthread_create(&t[i], NULL, w, NULL);
    for (int i = 0; i < th; i++) pthread_join(t[i], NULL);
    double el = now() - t0;
    printf("%s size %3zuM x2 threads %d: %.4f s (%.2f GB/s)\n", m == 0 ? "hostalloc" : m == 1 ? "reg-populate" : "reg-thp", SZ >> 20, th, el, 2.0 * th * SZ / el / 1e9);
  }
  return 0;
}
