/* A pass of work items over threads (`run`), each thread with scratch memory of its own: torch's
 * OpenMP threads where built with -fopenmp, else pthreads. Included by cpu_attention.c (not built
 * alone); every entry point of the library runs its work through it. */
#if defined(BATCHGEN_SIMD)

/* One parallel pass: `item` over work items 0..items-1, shared out as threads come for them; each
 * thread has `scratch` bytes of its own. */
typedef struct {
    void (*item)(const void *job, int w, void *scratch);
    const void *job;
    size_t scratch;
    int items, next, done;
} Pass;

static void *worker(void *arg) {
    Pass *p = arg;
    void *scratch = aligned_alloc(64, (p->scratch + 63) / 64 * 64);
    if (!scratch) return NULL; /* this thread takes no items: the others do them */
    for (int w; (w = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED)) < p->items;) {
        p->item(p->job, w, scratch);
        __atomic_fetch_add(&p->done, 1, __ATOMIC_RELAXED);
    }
    free(scratch);
    return NULL;
}

/* Runs a pass on `threads` threads (the caller's among them); 0 when every item was done. */
static int run(void (*item)(const void *, int, void *), const void *job, int items, size_t scratch, int threads) {
    Pass p = {item, job, scratch, items, 0, 0};
    threads = threads < 1 ? 1 : threads > items ? items : threads;
    if (threads < 1) return 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    worker(&p);
#else
    pthread_t ids[threads];
    int started = 0;
    for (; started < threads - 1; started++)
        if (pthread_create(&ids[started], NULL, worker, &p)) break;
    worker(&p);
    for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
#endif
    return p.done != items;
}
#endif /* BATCHGEN_SIMD */
