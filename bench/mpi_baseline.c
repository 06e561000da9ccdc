/* Direct-MPI baseline for `ferrozero bench comm --backend mpi --json`: Open MPI's
 * MPI_Allreduce, MPI_Reduce_scatter_block and MPI_Allgather on f32 sums, measured exactly as
 * ferrozero's bench measures (runtime/src/comm/bench.rs): buffers of ones, the largest buffer of
 * the call as "bytes", one warm-up call, a barrier, then max(3, min(1000, 1 GiB / bytes)) calls
 * timed, the mean time per call taken on the slowest rank; bus bandwidth by nccl-tests' factors.
 * JSON lines from rank 0, the same fields as ferrozero's rows.
 *
 *   mpicc -O2 bench/mpi_baseline.c -o mpi_baseline
 *   mpirun -n 2 ./mpi_baseline [MIN_BYTES [MAX_BYTES [in_place]]]
 *
 * `in_place` runs MPI_Allreduce with MPI_IN_PLACE (ferrozero's all_reduce is in place). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t iterations(size_t bytes) {
  size_t it = (size_t)1 << 30;
  it /= bytes ? bytes : 1;
  if (it < 3) it = 3;
  if (it > 1000) it = 1000;
  return it;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  size_t min = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 20;
  size_t max = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)256 << 20;
  int in_place = argc > 3 && strcmp(argv[3], "in_place") == 0;
  const char* names[3] = {"all_reduce", "reduce_scatter", "all_gather"};
  for (int op = 0; op < 3; op++) {
    for (size_t bytes = min < 4 ? 4 : min; bytes <= max; bytes *= 2) {
      size_t block = bytes / 4 / n;
      if (block == 0) block = 1;
      size_t total = block * n;
      float* big = malloc(total * 4);
      float* big2 = malloc(total * 4);
      float* small = malloc(block * 4);
      for (size_t i = 0; i < total; i++) big[i] = 1.0f;
      for (size_t i = 0; i < block; i++) small[i] = 1.0f;
      memset(big2, 0, total * 4);
      size_t iters = iterations(total * 4);
      double t = 0;
      for (size_t i = 0; i <= iters; i++) {
        if (i == 1) { MPI_Barrier(MPI_COMM_WORLD); t = MPI_Wtime(); }
        switch (op) {
          case 0:
            if (in_place) MPI_Allreduce(MPI_IN_PLACE, big, (int)total, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else MPI_Allreduce(big, big2, (int)total, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            break;
          case 1:
            MPI_Reduce_scatter_block(big, small, (int)block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            break;
          case 2:
            MPI_Allgather(small, (int)block, MPI_FLOAT, big, (int)block, MPI_FLOAT, MPI_COMM_WORLD);
            break;
        }
      }
      double secs = (MPI_Wtime() - t) / (double)iters, slowest;
      MPI_Allreduce(&secs, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      double algbw = (double)(total * 4) / slowest / 1e9;
      double factor = op == 0 ? 2.0 * (n - 1) / n : (double)(n - 1) / n;
      if (rank == 0)
        printf("{\"op\":\"%s\",\"bytes\":%zu,\"ranks\":%d,\"time_us\":%.3f,\"algbw_gbps\":%.4f,"
               "\"busbw_gbps\":%.4f}\n",
               names[op], total * 4, n, slowest * 1e6, algbw, algbw * factor);
      fflush(stdout);
      free(big); free(big2); free(small);
    }
  }
  MPI_Finalize();
  return 0;
}
