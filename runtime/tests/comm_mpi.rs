//! The MPI communicator under `mpirun -n 2` and `-n 4`. The default build has no MPI, so this
//! test builds the `mpi_collectives` example with `--features mpi` and runs it; where
//! `mpirun` is missing it says so and skips (CI installs Open MPI, see .ci/setup.d/mpi.sh).

use std::path::PathBuf;
use std::process::Command;

fn mpirun() -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("mpirun"))
            .find(|p| p.is_file())
    })
}

/// Builds the example in this test's profile and target directory; returns its path.
fn build_example() -> PathBuf {
    let release = !cfg!(debug_assertions);
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-p", "ferrozero-runtime", "--features", "mpi"])
        .args(["--example", "mpi_collectives"]);
    if release {
        cmd.arg("--release");
    }
    let out = cmd.output().expect("cargo runs");
    assert!(
        out.status.success(),
        "building the MPI example failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // This test runs from <target>/<profile>/deps/.
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap();
    profile_dir.join("examples").join("mpi_collectives")
}

fn run(mpirun: &PathBuf, exe: &PathBuf, n: usize) {
    let out = Command::new(mpirun)
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            &n.to_string(),
        ])
        .arg(exe)
        // Containers often forbid the cross-memory-attach syscalls of the shared-memory
        // transport; plain copies work everywhere.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .output()
        .expect("mpirun runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpirun -n {n} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for r in 0..n {
        // 37 calls of `check` (9 collectives each) and the sub-group, worker and failure cases.
        let line = format!("mpi_collectives rank {r}/{n}: 336 checks ok");
        assert!(
            stdout.contains(&line),
            "missing {line:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
    }
}

#[test]
fn mpi_collectives_with_2_and_4_processes() {
    let Some(mpirun) = mpirun() else {
        eprintln!(
            "SKIPPED: mpirun not found; install Open MPI (.ci/setup.d/mpi.sh) to run the MPI tests"
        );
        return;
    };
    let exe = build_example();
    run(&mpirun, &exe, 2);
    run(&mpirun, &exe, 4);
}
