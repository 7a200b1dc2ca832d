// graphmode generated CPU kernels: what the prelude declares, defined once per shared library
// (a library's parts are compiled separately; only the first part includes this).
// gm_threads is the library's OpenMP thread count, set from Python through gm_set_threads
// and read by every parallel region through gm_nt().
__attribute__((visibility("hidden"))) int gm_threads = 0;
GM_EXPORT void gm_set_threads(int n) { gm_threads = n < 0 ? 0 : n; }
GM_EXPORT int gm_get_threads(void) { return gm_nt(); }
