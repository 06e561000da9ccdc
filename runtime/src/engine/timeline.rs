//! A per-step memory timeline: the ledger's per-category peaks recorded after every step
//! and rendered as a self-contained SVG line chart (one polyline per category, axes, legend).
//!
//! The SVG is written by hand so a chart costs no plotting dependency; it opens in any
//! browser and diffs as text.

use std::fmt::Write as _;

use super::ledger::{Category, LedgerReport};

/// Which memory pool a chart shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// Accelerator memory (on CPU runs: the working set).
    Device,
    /// Host memory holding offloaded state.
    Host,
}

/// One recorded step: its number and the per-category peaks in [`Category::ALL`] order.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    step: u64,
    device: [u64; 6],
    host: [u64; 6],
}

/// Per-step ledger peaks, in recording order.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    samples: Vec<Sample>,
}

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 360.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 180.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
];

fn by_category(pairs: &[(Category, u64)]) -> [u64; 6] {
    let mut out = [0u64; 6];
    for (slot, cat) in out.iter_mut().zip(Category::ALL) {
        *slot = pairs.iter().find(|(c, _)| *c == cat).map_or(0, |&(_, b)| b);
    }
    out
}

impl Timeline {
    /// An empty timeline.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the ledger snapshot taken after `step` (usually `StepReport.memory`).
    pub fn record(&mut self, step: u64, memory: &LedgerReport) {
        self.samples.push(Sample {
            step,
            device: by_category(&memory.peak_device_by_category),
            host: by_category(&memory.peak_host_by_category),
        });
    }

    /// Number of recorded steps.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether nothing has been recorded.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Peak bytes of `cat` in `pool` at each recorded step, in recording order.
    pub fn series(&self, pool: Pool, cat: Category) -> Vec<(u64, u64)> {
        let idx = Category::ALL.iter().position(|&c| c == cat).unwrap_or(0);
        self.samples
            .iter()
            .map(|s| {
                let row = match pool {
                    Pool::Device => &s.device,
                    Pool::Host => &s.host,
                };
                (s.step, row[idx])
            })
            .collect()
    }

    /// Renders `pool` as an SVG line chart: x = step, y = peak MiB, one series per category.
    pub fn to_svg(&self, pool: Pool) -> String {
        let series: Vec<_> = Category::ALL
            .iter()
            .map(|&c| (c, self.series(pool, c)))
            .collect();
        let (x_min, x_max) = self.step_range();
        let y_max = series
            .iter()
            .flat_map(|(_, pts)| pts.iter().map(|&(_, b)| b))
            .max()
            .unwrap_or(0)
            .max(1) as f64;
        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let x_of = |step: u64| {
            let span = (x_max - x_min).max(1) as f64;
            LEFT + (step - x_min) as f64 / span * plot_w
        };
        let y_of = |bytes: u64| TOP + plot_h - bytes as f64 / y_max * plot_h;

        let mut svg = String::new();
        let title = match pool {
            Pool::Device => "Device memory peak per step",
            Pool::Host => "Host memory peak per step",
        };
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(svg, r#"<title>{title}</title>"#);
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="18" text-anchor="middle">{title}</text>"#,
            LEFT + plot_w / 2.0
        );
        write_axes(&mut svg, x_min, x_max, y_max, plot_w, plot_h);
        for (i, (cat, pts)) in series.iter().enumerate() {
            let points: Vec<String> = pts
                .iter()
                .map(|&(s, b)| format!("{:.1},{:.1}", x_of(s), y_of(b)))
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline class="series" data-category="{cat:?}" fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
                COLORS[i],
                points.join(" ")
            );
            let ly = TOP + 10.0 + i as f64 * 18.0;
            let lx = WIDTH - RIGHT + 15.0;
            let _ = writeln!(
                svg,
                r#"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{cat:?}</text>"#,
                ly - 10.0,
                COLORS[i],
                lx + 18.0,
                ly
            );
        }
        svg.push_str("</svg>\n");
        svg
    }

    fn step_range(&self) -> (u64, u64) {
        let min = self.samples.iter().map(|s| s.step).min().unwrap_or(0);
        let max = self.samples.iter().map(|s| s.step).max().unwrap_or(0);
        (min, max)
    }
}

/// Draws both axes with end labels; the y axis is in MiB because that is how budgets are set.
fn write_axes(svg: &mut String, x_min: u64, x_max: u64, y_max: f64, plot_w: f64, plot_h: f64) {
    let (x0, y0) = (LEFT, TOP + plot_h);
    let _ = writeln!(
        svg,
        r#"<line x1="{x0}" y1="{y0}" x2="{}" y2="{y0}" stroke="black"/><line x1="{x0}" y1="{TOP}" x2="{x0}" y2="{y0}" stroke="black"/>"#,
        x0 + plot_w
    );
    let mib = y_max / (1024.0 * 1024.0);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="end">{mib:.2} MiB</text><text x="{}" y="{y0}" text-anchor="end">0</text>"#,
        x0 - 5.0,
        TOP + 4.0,
        x0 - 5.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="{x0}" y="{}" text-anchor="middle">{x_min}</text><text x="{}" y="{}" text-anchor="middle">{x_max}</text><text x="{}" y="{}" text-anchor="middle">step</text>"#,
        y0 + 16.0,
        x0 + plot_w,
        y0 + 16.0,
        x0 + plot_w / 2.0,
        y0 + 34.0
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u64) -> LedgerReport {
        let device: Vec<_> = Category::ALL
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, (i as u64 + 1) * 1024 * (step + 1)))
            .collect();
        LedgerReport {
            peak_device_bytes: 0,
            peak_host_bytes: 0,
            peak_nvme_bytes: 0,
            current_device_bytes: 0,
            peak_device_by_category: device,
            peak_host_by_category: vec![(Category::OptimizerState, 4096)],
            device_memory_limit: None,
            peak_page_locked_bytes: 0,
        }
    }

    #[test]
    fn records_series_per_category() {
        let mut t = Timeline::new();
        assert!(t.is_empty());
        for s in 1..=3 {
            t.record(s, &report(s));
        }
        assert_eq!(t.len(), 3);
        let grads = t.series(Pool::Device, Category::Gradients);
        assert_eq!(grads, vec![(1, 4096), (2, 6144), (3, 8192)]);
        let host = t.series(Pool::Host, Category::Parameters);
        assert_eq!(host, vec![(1, 0), (2, 0), (3, 0)]);
        let opt = t.series(Pool::Host, Category::OptimizerState);
        assert_eq!(opt[2], (3, 4096));
    }

    #[test]
    fn svg_is_well_formed_with_one_series_per_category() {
        let mut t = Timeline::new();
        for s in 0..5 {
            t.record(s, &report(s));
        }
        let svg = t.to_svg(Pool::Device);
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), Category::ALL.len());
        for cat in Category::ALL {
            assert!(svg.contains(&format!("data-category=\"{cat:?}\"")));
            assert!(svg.contains(&format!(">{cat:?}</text>")));
        }
        // Balanced tags: every opened element is closed or self-closed.
        let opens = svg.matches('<').count();
        let closes = svg.matches("</").count() + svg.matches("/>").count();
        assert_eq!(opens, closes * 2 - svg.matches("/>").count());
        // The largest sample sits at the top of the plot, the x axis spans the steps.
        assert!(svg.contains(&format!(",{TOP:.1}")));
        assert!(svg.contains(">0</text>") && svg.contains(">4</text>"));
    }

    #[test]
    fn empty_timeline_renders_axes_without_panicking() {
        let svg = Timeline::new().to_svg(Pool::Host);
        assert_eq!(svg.matches("<polyline").count(), Category::ALL.len());
        assert!(svg.contains("Host memory"));
    }
}
