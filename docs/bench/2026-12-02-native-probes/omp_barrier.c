#include <omp.h>
#include <stdio.h>
int main() {
  for (int rep = 0; rep < 5; ++rep) {
    double t0 = omp_get_wtime();
    int N = 42000;
#pragma omp parallel num_threads(2)
    {
      for (int i = 0; i < N; ++i) {
#pragma omp barrier
      }
    }
    double t1 = omp_get_wtime();
    // single + barrier pattern
#pragma omp parallel num_threads(2)
    {
      for (int i = 0; i < N; ++i) {
#pragma omp single
        { volatile int x = i; (void)x; }
      }
    }
    double t2 = omp_get_wtime();
    printf("barrier %.2f us, single %.2f us\n", (t1 - t0) / N * 1e6, (t2 - t1) / N * 1e6);
  }
}
