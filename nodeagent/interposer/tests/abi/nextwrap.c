/* A second preloaded library, loaded after libvgpu_cuda.so, that wraps getppid the usual way:
 * dlsym(RTLD_NEXT, "getppid"), and adds 1000000 so the test sees it ran. glibc resolves
 * RTLD_NEXT relative to the caller, so this must find libc's getppid. If the interposer's dlsym
 * made the lookup relative to itself instead, it would find this very function and recurse until
 * the stack overflows. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/types.h>

pid_t getppid(void) {
  pid_t (*real)(void) = (pid_t(*)(void))dlsym(RTLD_NEXT, "getppid");
  return real() + 1000000;
}
