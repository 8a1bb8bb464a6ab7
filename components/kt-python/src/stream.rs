//! `_kt.ShareStream`: kt-client's streamed share of a dataset
//! ([`kt_client::stream`]) for `kt.Dataset` (python/kt/stream.py), which
//! turns its files into paths, bytes or Arrow record batches.
//!
//! The stream holds the file it last handed out until the next call (or
//! `release()`): then that file is deleted and its bytes go back to the
//! budget. Every wait releases the GIL and looks for signals (Ctrl-C), as
//! every other call of the package does.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kt_client::stream::{Gauge, ShareStream, StreamOptions, StreamedFile};
use kt_types::KeyPrefix;
use kt_types::shard::{Shard, ShareSpec};
use pyo3::prelude::*;

use crate::errors::invalid;
use crate::{Call, Ctx, ctx, locked, run_call};

/// One file handed out: `(position, path below the prefix, local path,
/// size)`.
type FileTuple = (usize, String, String, u64);

/// A rank's share of the files below a prefix, streamed (see the module
/// documentation).
#[pyclass(module = "kt._kt", name = "ShareStream")]
pub struct PyShareStream {
    ctx: Arc<Ctx>,
    name: String,
    stream: Arc<tokio::sync::Mutex<ShareStream>>,
    /// The file last handed out, until the consumer moves on.
    current: Mutex<Option<StreamedFile>>,
    /// `(path below the prefix, size)` of the whole share, in order.
    share: Vec<(String, u64)>,
    position: Mutex<usize>,
    gauge: Gauge,
    dir: String,
}

impl std::fmt::Debug for PyShareStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShareStream")
            .field("name", &self.name)
            .field("files", &self.share.len())
            .field("position", &*locked(&self.position))
            .finish_non_exhaustive()
    }
}

#[pymethods]
impl PyShareStream {
    /// Lists the dataset below `prefix` and starts streaming rank `rank` of
    /// `world`'s share from `start`, holding at most `budget` bytes (a file
    /// larger than that is fetched alone).
    #[new]
    #[pyo3(signature = (prefix, rank, world, epoch=0, shuffle=false, budget=1<<30, start=0, ahead=4, dir=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        prefix: &str,
        rank: u32,
        world: u32,
        epoch: u64,
        shuffle: bool,
        budget: u64,
        start: usize,
        ahead: usize,
        dir: Option<PathBuf>,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let shard = Shard::new(rank, world).map_err(|e| invalid(e.to_string()))?;
        if ahead == 0 {
            return Err(invalid("ahead: at least 1 file, not 0"));
        }
        let prefix = KeyPrefix::parse(prefix).map_err(|e| invalid(format!("prefix: {e}")))?;
        let c = ctx()?;
        let name = format!("kt.Dataset({:?}, shard {shard})", format!("{prefix}/"));
        let call = Call::new(name.clone(), timeout, None)?;
        let client = call.client(&c);
        let opts = StreamOptions {
            start,
            ahead,
            dir,
            ..StreamOptions::new(
                ShareSpec {
                    shard,
                    epoch,
                    shuffle,
                },
                budget,
            )
        };
        let stream = run_call(py, &c, &call, async move {
            client.stream_share(&prefix, opts).await
        })?;
        let share = stream
            .share()
            .iter()
            .map(|f| (f.path.clone(), f.size))
            .collect();
        Ok(Self {
            gauge: stream.gauge(),
            dir: stream.dir().display().to_string(),
            ctx: c,
            name,
            position: Mutex::new(stream.position()),
            stream: Arc::new(tokio::sync::Mutex::new(stream)),
            current: Mutex::new(None),
            share,
        })
    }

    /// Lets go of the file last handed out (deleted, its bytes back to the
    /// budget), then waits for the next one: `None` at the end.
    fn next_file(&self, py: Python<'_>) -> PyResult<Option<FileTuple>> {
        self.release();
        let stream = self.stream.clone();
        let call = Call::new(self.name.clone(), None, None)?;
        let got = run_call(py, &self.ctx, &call, async move {
            stream.lock().await.next().await.transpose()
        })?;
        let Some(f) = got else {
            *locked(&self.position) = self.share.len();
            return Ok(None);
        };
        *locked(&self.position) = f.position + 1;
        let t = (
            f.position,
            f.file.path.clone(),
            f.path.display().to_string(),
            f.file.size,
        );
        *locked(&self.current) = Some(f);
        Ok(Some(t))
    }

    /// Deletes the file last handed out and gives its bytes back.
    fn release(&self) {
        let done = locked(&self.current).take();
        drop(done);
    }

    /// The index in the ordered share of the next file (a checkpoint).
    #[getter]
    fn position(&self) -> usize {
        *locked(&self.position)
    }

    /// `(path below the prefix, size)` of this rank's files, in order.
    #[getter]
    fn share(&self) -> Vec<(String, u64)> {
        self.share.clone()
    }

    /// `(held now, most held so far, budget)` in bytes.
    fn held(&self) -> (u64, u64, u64) {
        let g = &self.gauge;
        (g.held(), g.peak(), g.budget())
    }

    /// Where files are placed.
    #[getter]
    fn dir(&self) -> String {
        self.dir.clone()
    }
}

/// `kt get PREFIX/ --shard RANK/WORLD`: fetches the share into
/// `dest/<path below the prefix>` and says `(path below the prefix, local
/// path, size)` per file, in reading order.
#[pyfunction]
#[pyo3(signature = (prefix, dest, rank, world, epoch=0, shuffle=false, timeout=None))]
#[allow(clippy::too_many_arguments)]
pub fn get_share(
    py: Python<'_>,
    prefix: &str,
    dest: PathBuf,
    rank: u32,
    world: u32,
    epoch: u64,
    shuffle: bool,
    timeout: Option<f64>,
) -> PyResult<Vec<(String, String, u64)>> {
    let shard = Shard::new(rank, world).map_err(|e| invalid(e.to_string()))?;
    let prefix = KeyPrefix::parse(prefix).map_err(|e| invalid(format!("prefix: {e}")))?;
    let c = ctx()?;
    let call = Call::new(
        format!("kt.get_shard({:?}, shard {shard})", format!("{prefix}/")),
        timeout,
        None,
    )?;
    let client = call.client(&c);
    let spec = ShareSpec {
        shard,
        epoch,
        shuffle,
    };
    let to = dest.clone();
    let got = run_call(py, &c, &call, async move {
        client.get_share(&prefix, &spec, &to).await
    })?;
    Ok(got
        .files
        .iter()
        .map(|f| {
            let local = dest.join(&f.path).display().to_string();
            (f.path.clone(), local, f.size)
        })
        .collect())
}
