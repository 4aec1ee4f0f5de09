// Measurement script of this folder (run on the device, not part of the package): LD_PRELOAD shim writing every kernel / memcpy / memset / runtime-API
// activity record to $CUPTI_OUT as text lines; cupti_now() gives a window marker on the same clock.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#if CUPTI_API_VERSION >= 130200
typedef CUpti_ActivityKernel11 KREC;
#elif CUPTI_API_VERSION >= 130000
typedef CUpti_ActivityKernel10 KREC;
#else
typedef CUpti_ActivityKernel9 KREC;
#endif
static FILE *out;
static void CUPTIAPI req(uint8_t **buf, size_t *size, size_t *maxn) {
  *size = 32 << 20; *buf = aligned_alloc(8, *size); *maxn = 0;
}
static void CUPTIAPI done(CUcontext c, uint32_t s, uint8_t *buf, size_t size, size_t valid) {
  CUpti_Activity *r = NULL;
  while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      KREC *k = (KREC *)r;
      fprintf(out, "K %llu %llu %u %u %s\n", (unsigned long long)k->start, (unsigned long long)k->end,
              k->correlationId, k->streamId, k->name ? k->name : "?");
    } else if (r->kind == CUPTI_ACTIVITY_KIND_RUNTIME || r->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)r;
      const char *name = "?";
      cuptiGetCallbackName(r->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API,
                           a->cbid, &name);
      fprintf(out, "A %llu %llu %u 0 %s\n", (unsigned long long)a->start, (unsigned long long)a->end,
              a->correlationId, name ? name : "?");
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      CUpti_Activity *m = r;  // start/end sit at the same place in every memcpy record version
      CUpti_ActivityMemcpy6 *mc = (CUpti_ActivityMemcpy6 *)m;
      fprintf(out, "M %llu %llu %u %u memcpy_%d_%llu\n", (unsigned long long)mc->start, (unsigned long long)mc->end,
              mc->correlationId, mc->streamId, (int)mc->copyKind, (unsigned long long)mc->bytes);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      CUpti_ActivityMemset4 *ms = (CUpti_ActivityMemset4 *)r;
      fprintf(out, "M %llu %llu %u %u memset_%llu\n", (unsigned long long)ms->start, (unsigned long long)ms->end,
              ms->correlationId, ms->streamId, (unsigned long long)ms->bytes);
    }
  }
  free(buf);
}
unsigned long long cupti_now(void) { uint64_t t = 0; cuptiGetTimestamp(&t); return t; }
void cupti_flush(void) { cuptiActivityFlushAll(1); fflush(out); }
__attribute__((constructor)) static void init(void) {
  const char *p = getenv("CUPTI_OUT");
  out = fopen(p ? p : "/tmp/cupti.txt", "w");
  cuptiActivityRegisterCallbacks(req, done);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
}
__attribute__((destructor)) static void fini(void) { cuptiActivityFlushAll(1); if (out) fclose(out); }
