//! The files one monitor writes: TensorBoard's event file and DeepSpeed's CSV files.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::tfevents;
use crate::{Error, Result};

/// Where a step's scalars go.
pub(super) trait Sink: Send {
    /// Writes one step's scalars (buffered).
    fn write(&mut self, step: u64, wall_time: f64, scalars: &[(String, f64)]) -> Result<()>;
    /// Pushes buffered bytes to the files.
    fn flush(&mut self) -> Result<()>;
}

fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::File {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// Creates `dir` (and its parents) or says which directory could not be made.
pub(super) fn make_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))
}

/// One event file, `events.out.tfevents.<seconds>.<host>.<pid>.0` as PyTorch's
/// `SummaryWriter` names it (TensorBoard finds files by the `tfevents` in the name).
pub(super) struct TensorBoard {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorBoard {
    pub(super) fn create(dir: &Path, wall_time: f64) -> Result<Self> {
        make_dir(dir)?;
        let name = format!(
            "events.out.tfevents.{}.{}.{}.0",
            wall_time as u64,
            hostname(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::create(&path).map_err(|e| io_error(&path, e))?;
        let mut tb = TensorBoard {
            out: BufWriter::with_capacity(1 << 16, file),
            path,
        };
        tfevents::write_record(&mut tb.out, &tfevents::file_version_event(wall_time))
            .map_err(|e| io_error(&tb.path, e))?;
        Ok(tb)
    }
}

impl Sink for TensorBoard {
    fn write(&mut self, step: u64, wall_time: f64, scalars: &[(String, f64)]) -> Result<()> {
        let event = tfevents::scalars_event(wall_time, step as i64, scalars);
        tfevents::write_record(&mut self.out, &event).map_err(|e| io_error(&self.path, e))
    }
    fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| io_error(&self.path, e))
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or
    // truncates, and we stop at the first NUL or the end.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..end]) {
        Ok(h) if rc == 0 && !h.is_empty() => h.replace(['/', ' '], "_"),
        _ => "localhost".into(),
    }
}

/// DeepSpeed's CSV monitor: one file per scalar, named after its tag with `/` and spaces
/// made `_` (`Train_Samples_train_loss.csv`), appended to, with the header `step,<last part
/// of the tag>` written the first time this run writes the file.
pub(super) struct Csv {
    dir: PathBuf,
    files: HashMap<String, (PathBuf, BufWriter<File>)>,
}

impl Csv {
    pub(super) fn create(dir: &Path) -> Result<Self> {
        make_dir(dir)?;
        Ok(Csv {
            dir: dir.to_path_buf(),
            files: HashMap::new(),
        })
    }

    fn file(&mut self, tag: &str) -> Result<&mut (PathBuf, BufWriter<File>)> {
        if !self.files.contains_key(tag) {
            let name = tag.replace(['/', ' '], "_");
            let path = self.dir.join(format!("{name}.csv"));
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|e| io_error(&path, e))?;
            let mut out = BufWriter::new(file);
            let header = tag.rsplit('/').next().unwrap_or(tag);
            writeln!(out, "step,{header}").map_err(|e| io_error(&path, e))?;
            self.files.insert(tag.to_string(), (path, out));
        }
        Ok(self.files.get_mut(tag).expect("inserted above"))
    }
}

impl Sink for Csv {
    fn write(&mut self, step: u64, _wall_time: f64, scalars: &[(String, f64)]) -> Result<()> {
        for (tag, v) in scalars {
            let (path, out) = self.file(tag)?;
            writeln!(out, "{step},{v}").map_err(|e| io_error(path, e))?;
        }
        Ok(())
    }
    fn flush(&mut self) -> Result<()> {
        for (path, out) in self.files.values_mut() {
            out.flush().map_err(|e| io_error(path, e))?;
        }
        Ok(())
    }
}
