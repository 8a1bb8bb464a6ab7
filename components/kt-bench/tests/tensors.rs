//! The tensor benchmark end to end at a tiny size: two agents and a metadata
//! server in process, every case measured and checked (not its speed).

use kt_bench::tensors::{self, Options, PACKED, TCP, UNPACKED};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_quick_benchmark_measures_every_case() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Options {
        size: 4 << 20,
        tensors: 20,
        runs: 1,
        ..Options::quick(dir.path())
    };
    let r = tensors::run(&opts).await.expect("benchmark");
    assert_eq!((r.bytes, r.tensors), (4 << 20, 20));
    let names: Vec<&str> = r.cases.iter().map(|c| c.name).collect();
    assert_eq!(names, [PACKED, UNPACKED, TCP]);
    for c in &r.cases {
        assert_eq!(c.secs.len(), 1, "{}", c.name);
        assert!(c.median() > 0.0 && c.median().is_finite(), "{c:?}");
    }
    // Packed: three dtypes, each in one bucket; unpacked: one per tensor.
    assert!(
        r.case(PACKED).unwrap().what.contains(" 3 collectives"),
        "{r:?}"
    );
    assert!(
        r.case(UNPACKED).unwrap().what.contains(" 20 collectives"),
        "{r:?}"
    );
    assert_eq!(r.table().lines().count(), 4);
    let line = r.ratio_line();
    for field in [
        "packed_vs_tcp=",
        "unpacked_vs_tcp=",
        "packed_vs_unpacked=",
        "per_tensor_overhead_us=",
    ] {
        assert!(line.contains(field), "{line}");
    }
    // The work directory (and its shared memory) is gone.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
