/* The kernels' scratch buffers given back: every source file's thread_scratch buffers (dtypes.h) freed, on the
 * calling thread and on each thread of its OpenMP team of `num_threads` (the kernels' parallel regions run on the
 * same pooled threads, which grow buffers of their own: a tower attention's keys, values and scores, 2.4 MB a
 * thread at 4,096 patches, stayed with the worker when only the calling thread's were freed). Each file registers
 * its releaser when the library is loaded (a constructor); the engine calls release_scratch on the thread that ran
 * start-up's timings and calibration, once they are done, and steps grow the buffers again to what they need. Not
 * to be called while a kernel runs. */
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "dtypes.h"
#include "kernels.h"

#define MAX_FILES 32
static void (*releasers[MAX_FILES])(void);
static int registered;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

void register_scratch(void (*release)(void)) {
    pthread_mutex_lock(&lock);
    if (registered < MAX_FILES) releasers[registered++] = release;
    pthread_mutex_unlock(&lock);
}

int release_scratch(int num_threads) {
    pthread_mutex_lock(&lock);
    const int count = registered;  /* the constructors registered every file when the library was loaded */
    pthread_mutex_unlock(&lock);
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    for (int i = 0; i < count; i++) releasers[i]();
    return 0;
}
