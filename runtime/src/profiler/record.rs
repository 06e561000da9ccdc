//! What the profiling backend records while a step is profiled: per (module, kernel family)
//! the calls, FLOPs and seconds, and which module the training thread is in.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use serde::Serialize;

/// `Family` from one list of its variants and their names: the enum, `ALL` in the list's
/// (table) order and `name`.
macro_rules! families {
    ($($(#[doc = $doc:literal])* $v:ident => $name:literal,)*) => {
        /// The kernel families the profiler sorts operations into.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(rename_all = "lowercase")]
        pub enum Family {
            $($(#[doc = $doc])* $v,)*
        }

        impl Family {
            /// Every family, in table order.
            pub const ALL: [Family; 8] = [$(Family::$v),*];

            /// The family's name in tables and metrics.
            pub fn name(self) -> &'static str {
                match self {
                    $(Family::$v => $name,)*
                }
            }
        }
    };
}

families! {
    /// Matrix products (linear layers).
    Matmul => "matmul",
    /// Attention and rotary embeddings.
    Attention => "attention",
    /// LayerNorm and RMSNorm.
    Norm => "norm",
    /// Pointwise operations, dropout, reductions, embedding lookups.
    Elementwise => "elementwise",
    /// The loss head (logits and cross-entropy) and arg-max.
    Loss => "loss",
    /// Optimizer updates.
    Optimizer => "optimizer",
    /// Copies, uploads and fills.
    Memory => "memory",
    /// Collectives between ranks (timed by the communicator, not the backend).
    Communication => "communication",
}

/// Calls, FLOPs and seconds of one (module, family) cell.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Cell {
    /// Operations recorded.
    pub calls: u64,
    /// Their FLOPs (see `flops`).
    pub flops: u64,
    /// Their time, seconds.
    pub seconds: f64,
}

impl Cell {
    pub(super) fn add(&mut self, o: &Cell) {
        self.calls += o.calls;
        self.flops += o.flops;
        self.seconds += o.seconds;
    }
}

/// Module names for operations outside any unit.
pub(super) const ENGINE: &str = "engine";
/// The training thread's optimizer updates, inside a unit or not.
pub(super) const OPTIMIZER: &str = "optimizer";
/// Operations issued by threads other than the training thread (the communication worker,
/// the optimizer lane): they overlap the training thread's time.
pub(super) const BACKGROUND: &str = "background";

#[derive(Default)]
struct State {
    /// The training thread and its stack of unit names (a recomputed forward nests).
    owner: Option<ThreadId>,
    scopes: Vec<Arc<str>>,
    cells: BTreeMap<(Arc<str>, Family), Cell>,
}

/// Shared by the profiling backend, the scoped units and the engine's hooks.
#[derive(Default)]
pub struct Recorder {
    active: AtomicBool,
    state: Mutex<State>,
}

impl Recorder {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a step is being profiled (one atomic load: all the wrapper costs otherwise).
    pub(super) fn active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Starts recording on the calling (training) thread, from empty cells.
    pub(super) fn start(&self) {
        let mut s = self.state();
        s.owner = Some(std::thread::current().id());
        s.cells.clear();
        drop(s);
        self.active.store(true, Ordering::Release);
    }

    /// Stops recording and hands back the cells.
    pub(super) fn stop(&self) -> BTreeMap<(Arc<str>, Family), Cell> {
        self.active.store(false, Ordering::Release);
        std::mem::take(&mut self.state().cells)
    }

    /// The training thread enters unit `name` until the guard drops.
    pub(super) fn enter(self: &Arc<Self>, name: &Arc<str>) -> ScopeGuard {
        self.state().scopes.push(name.clone());
        ScopeGuard(self.clone())
    }

    /// Adds one operation to the cell of the calling thread's module.
    pub(super) fn add(&self, family: Family, flops: u64, seconds: f64) {
        let mut s = self.state();
        let module: Arc<str> = if s.owner != Some(std::thread::current().id()) {
            BACKGROUND.into()
        } else if family == Family::Optimizer {
            OPTIMIZER.into()
        } else {
            s.scopes.last().cloned().unwrap_or_else(|| ENGINE.into())
        };
        let c = s.cells.entry((module, family)).or_default();
        c.calls += 1;
        c.flops += flops;
        c.seconds += seconds;
    }
}

/// Leaves a unit's scope on drop (also when its forward or backward fails).
pub(super) struct ScopeGuard(Arc<Recorder>);

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        self.0.state().scopes.pop();
    }
}
