//! GFLOP/s (median and best rep) of the CPU backend's matmul at one shape (default: the 15M GPT's MLP input,
//! 1024x1536x384), on a pool of `--threads` threads, printed as JSON.
//!
//! `cargo run --release -p ferrozero-runtime --example bench_matmul -- [m n k] [--threads 2]`

use std::time::Instant;

use ferrozero_runtime::backend::{self, Epilogue, MatmulShape, Transpose};
use ferrozero_runtime::tensor::{View, ViewMut};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(2);
    let dims: Vec<usize> = args.iter().take(3).filter_map(|a| a.parse().ok()).collect();
    let (m, n, k) = match dims[..] {
        [m, n, k] => (m, n, k),
        _ => (1024, 1536, 384),
    };
    let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 13) as f32 * 0.01).collect();
    let mut c = vec![0.0f32; m * n];
    let s = MatmulShape {
        m,
        n,
        k,
        ta: Transpose::No,
        tb: Transpose::No,
    };
    let be = backend::cpu();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let reps = 20;
    let secs = pool.install(|| {
        for _ in 0..3 {
            let (av, bv) = (View::from(&a[..]), View::from(&b[..]));
            be.matmul(s, av, bv, ViewMut::from(&mut c[..]), Epilogue::Store)
                .expect("shapes agree");
        }
        let mut times: Vec<f64> = (0..reps)
            .map(|_| {
                let (av, bv) = (View::from(&a[..]), View::from(&b[..]));
                let t0 = Instant::now();
                be.matmul(s, av, bv, ViewMut::from(&mut c[..]), Epilogue::Store)
                    .expect("shapes agree");
                t0.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        (times[reps / 2], times[0])
    });
    let rate = |t: f64| 2.0 * (m * n * k) as f64 / t / 1e9;
    let (gflops, best) = (rate(secs.0), rate(secs.1));
    println!("{{\"bench\": \"ferrozero_matmul\", \"m\": {m}, \"n\": {n}, \"k\": {k}, \"threads\": {threads}, \"gflops\": {gflops:.1}, \"best_gflops\": {best:.1}}}");
}
