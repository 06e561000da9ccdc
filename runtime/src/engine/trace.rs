//! A recorded schedule: which lane ran which piece of work, from when to when. Off unless
//! asked for ([`crate::engine::Engine::trace_schedule`]); it is how a test (or a user reading
//! a slow step) sees that the optimizer really ran while backward went on.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One piece of work on one lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// The lane that ran it: `"compute"` (the engine's own thread) or `"optimizer"`.
    pub lane: &'static str,
    /// What ran: `"backward"` (one unit) or `"step"` (one group's optimizer update).
    pub op: &'static str,
    /// The unit or group index.
    pub index: usize,
    /// Start, since tracing was switched on.
    pub start: Duration,
    /// End, since tracing was switched on.
    pub end: Duration,
}

/// Where spans are recorded; cheap to clone into a lane's jobs. Records nothing when off.
#[derive(Debug, Clone, Default)]
pub(crate) struct Trace {
    sink: Option<Arc<Mutex<Sink>>>,
}

#[derive(Debug)]
struct Sink {
    origin: Instant,
    spans: Vec<Span>,
}

impl Trace {
    /// A trace that records from now on.
    pub(crate) fn on() -> Self {
        Self {
            sink: Some(Arc::new(Mutex::new(Sink {
                origin: Instant::now(),
                spans: Vec::new(),
            }))),
        }
    }

    /// Runs `f`, recording it as `op` on `index` on `lane` when tracing is on.
    pub(crate) fn span<R>(
        &self,
        lane: &'static str,
        op: &'static str,
        index: usize,
        f: impl FnOnce() -> R,
    ) -> R {
        let Some(sink) = &self.sink else {
            return f();
        };
        let t0 = Instant::now();
        let r = f();
        let t1 = Instant::now();
        let mut s = sink.lock().unwrap_or_else(|p| p.into_inner());
        let origin = s.origin;
        s.spans.push(Span {
            lane,
            op,
            index,
            start: t0.saturating_duration_since(origin),
            end: t1.saturating_duration_since(origin),
        });
        r
    }

    /// The spans recorded so far, oldest first; the trace keeps recording.
    pub(crate) fn take(&self) -> Vec<Span> {
        self.sink.as_ref().map_or_else(Vec::new, |s| {
            std::mem::take(&mut s.lock().unwrap_or_else(|p| p.into_inner()).spans)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_when_on_and_in_order() {
        let off = Trace::default();
        assert_eq!(off.span("compute", "backward", 0, || 7), 7);
        assert!(off.take().is_empty());
        let on = Trace::on();
        on.span("compute", "backward", 2, || ());
        on.clone().span("optimizer", "step", 1, || ());
        let spans = on.take();
        assert_eq!(spans.len(), 2);
        assert_eq!((spans[0].op, spans[0].index), ("backward", 2));
        assert_eq!((spans[1].lane, spans[1].index), ("optimizer", 1));
        assert!(spans[0].start <= spans[0].end && spans[0].end <= spans[1].start);
        assert!(on.take().is_empty());
    }
}
