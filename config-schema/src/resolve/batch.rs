//! DeepSpeed's batch rule: `train_batch_size = micro × gradient_accumulation_steps × world`,
//! deriving a missing value by integer division and then checking the equality.

use super::{to_usize, Resolver};
use crate::diagnostic::DiagnosticKind;
use crate::model::AutoOr;

const TRAIN: &str = "train_batch_size";
const MICRO: &str = "train_micro_batch_size_per_gpu";
const GAS: &str = "gradient_accumulation_steps";

/// Returns (train, micro, accumulation); on failure records an error and returns zeros.
pub(super) fn resolve_batch(r: &mut Resolver<'_>) -> (usize, usize, usize) {
    let world = r.ctx.world_size;
    if world == 0 {
        r.fail(
            DiagnosticKind::BatchSize,
            "",
            "the world size must be at least 1".into(),
            None,
            vec![],
        );
        return (0, 0, 0);
    }
    let c = r.config;
    let train = given(c.train_batch_size);
    let gas = given(c.gradient_accumulation_steps);
    let micro = match c.train_micro_batch_size_per_gpu {
        Some(AutoOr::Auto) => match r.ctx.micro_batch_hint {
            Some(m) => {
                r.decide(MICRO, m, "\"auto\": the caller's micro-batch");
                Some(m)
            }
            None => {
                r.missing(MICRO, "no micro-batch size was given by the caller");
                return (0, 0, 0);
            }
        },
        other => given(other),
    };
    let derived = derive(train, micro, gas, world);
    let Some((t, m, g)) = derived else {
        r.fail(
            DiagnosticKind::BatchSize,
            TRAIN,
            "cannot derive the batch sizes".into(),
            Some(format!("set `{TRAIN}` or `{MICRO}`")),
            vec![values(train, micro, gas, world)],
        );
        return (0, 0, 0);
    };
    for (path, before, after) in [(TRAIN, train, t), (MICRO, micro, m), (GAS, gas, g)] {
        if before.is_none() {
            r.decide(
                path,
                after,
                &format!("derived: {TRAIN} = {MICRO} × {GAS} × world size ({world})"),
            );
        }
    }
    if m == 0 || g == 0 || t == 0 || t != m.saturating_mul(g).saturating_mul(world) {
        r.fail(
            DiagnosticKind::BatchSize,
            TRAIN,
            format!("{TRAIN} != {MICRO} × {GAS} × world size: {t} != {m} × {g} × {world}"),
            Some(format!(
                "change one of them, or run with a world size that divides {t} / ({m} × {g})"
            )),
            vec![values(Some(t), Some(m), Some(g), world)],
        );
    }
    (t, m, g)
}

fn given(v: Option<AutoOr<u64>>) -> Option<usize> {
    v.and_then(|v| v.value()).map(to_usize)
}

/// DeepSpeed's `_set_batch_related_parameters`, with zero guarded against division.
fn derive(
    train: Option<usize>,
    micro: Option<usize>,
    gas: Option<usize>,
    world: usize,
) -> Option<(usize, usize, usize)> {
    let div = |a: usize, b: usize| a.checked_div(b).unwrap_or(0);
    match (train, micro, gas) {
        (Some(t), Some(m), Some(g)) => Some((t, m, g)),
        (Some(t), Some(m), None) => Some((t, m, div(div(t, m), world))),
        (Some(t), None, Some(g)) => Some((t, div(div(t, world), g), g)),
        (None, Some(m), Some(g)) => Some((m.saturating_mul(g).saturating_mul(world), m, g)),
        (Some(t), None, None) => Some((t, div(t, world), 1)),
        (None, Some(m), None) => Some((m.saturating_mul(world), m, 1)),
        (None, None, _) => None,
    }
}

fn values(t: Option<usize>, m: Option<usize>, g: Option<usize>, world: usize) -> String {
    let show = |v: Option<usize>| v.map_or("unset".to_string(), |v| v.to_string());
    format!(
        "{TRAIN} = {}, {MICRO} = {}, {GAS} = {}, world size = {world}",
        show(t),
        show(m),
        show(g)
    )
}

#[cfg(test)]
mod tests {
    use super::derive;

    #[test]
    fn derives_like_deepspeed() {
        assert_eq!(derive(Some(32), Some(4), None, 2), Some((32, 4, 4)));
        assert_eq!(derive(Some(32), None, Some(2), 4), Some((32, 4, 2)));
        assert_eq!(derive(None, Some(4), Some(2), 3), Some((24, 4, 2)));
        assert_eq!(derive(Some(32), None, None, 4), Some((32, 8, 1)));
        assert_eq!(derive(None, Some(4), None, 4), Some((16, 4, 1)));
        assert_eq!(derive(None, None, Some(2), 4), None);
        // Integer division hides the mismatch here; the equality check catches it later.
        assert_eq!(derive(Some(30), Some(4), None, 2), Some((30, 4, 3)));
    }
}
