/* The kernels' scratch buffers given back: every source file's thread_scratch buffers (dtypes.h) of the calling
 * thread freed. Each file registers its releaser when the library is loaded (a constructor); the engine calls
 * release_scratch on the thread that ran start-up's timings and calibration, once they are done, and steps grow
 * the buffers again to what they need. Not to be called while a kernel runs on this thread. */
#include <pthread.h>

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

int release_scratch(void) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < registered; i++) releasers[i]();
    pthread_mutex_unlock(&lock);
    return 0;
}
