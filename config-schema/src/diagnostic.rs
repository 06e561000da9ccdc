//! Diagnostics: what went wrong, where (file:line:col with the source line), and how to fix it,
//! rendered like rustc's through `annotate-snippets`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use annotate_snippets::{AnnotationKind, Group, Level, Origin, Renderer, Snippet};
use serde::Serialize;

/// How serious a diagnostic is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The config is rejected.
    Error,
    /// The config is accepted; something was mapped or ignored.
    Warning,
}

/// The family a diagnostic belongs to, for tools that filter them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiagnosticKind {
    /// The file is not valid TOML/JSON.
    Syntax,
    /// A key that no ferrozero or DeepSpeed version knows.
    UnknownKey,
    /// A DeepSpeed key that ferrozero does not implement.
    Unsupported,
    /// A deprecated DeepSpeed key, mapped to its replacement.
    Deprecated,
    /// A value of the wrong type.
    WrongType,
    /// A value of the right type outside its valid range or set.
    InvalidValue,
    /// Keys that contradict each other.
    Conflict,
    /// An `"auto"` that could not be resolved.
    Auto,
    /// The batch-size rule `train = micro × accumulation × world` failed.
    BatchSize,
}

/// A position in a config file, with the line it is on (so a diagnostic renders on its own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Location {
    /// File name (or other origin) as given to the loader.
    pub origin: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
    /// The text of the line (without its newline), shared by every diagnostic on that line:
    /// a minified JSON file is one line of megabytes.
    #[serde(skip)]
    pub line_text: Arc<str>,
    /// Byte range of the offending text within `line_text`.
    #[serde(skip)]
    pub span_in_line: Range<usize>,
}

/// One finding about a config.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// Family.
    pub kind: DiagnosticKind,
    /// Dotted key path, e.g. `zero_optimization.offload_param.nvme_path` (empty for the root).
    pub path: String,
    /// What is wrong.
    pub message: String,
    /// How to fix it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub help: Option<String>,
    /// Further facts, e.g. every value involved in a failed cross-field rule.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Where the offending text is, when it came from a file.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub location: Option<Location>,
    /// Other places involved (e.g. the other side of a conflict), with a label each.
    #[serde(skip)]
    pub related: Vec<(Location, String)>,
}

/// Whether rendered diagnostics carry ANSI colours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenderStyle {
    /// Plain text (files, pipes, tests).
    Plain,
    /// Coloured (terminals).
    Styled,
}

impl Diagnostic {
    /// True for errors.
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }

    /// Renders this diagnostic rustc-style.
    pub fn render(&self, style: RenderStyle) -> String {
        let renderer = match style {
            RenderStyle::Plain => Renderer::plain(),
            RenderStyle::Styled => Renderer::styled(),
        };
        let level = match self.severity {
            Severity::Error => Level::ERROR,
            Severity::Warning => Level::WARNING,
        };
        let title = if self.path.is_empty() {
            self.message.clone()
        } else {
            format!("`{}`: {}", self.path, self.message)
        };
        let mut places: Vec<(&Location, AnnotationKind, &str)> = Vec::new();
        if let Some(loc) = &self.location {
            places.push((loc, AnnotationKind::Primary, ""));
        }
        for (loc, label) in &self.related {
            places.push((loc, AnnotationKind::Context, label.as_str()));
        }
        let mut group = Group::with_title(level.primary_title(title.as_str()));
        for (loc, kind, label) in places {
            group = if loc.line_text.len() > LONG_LINE {
                // Rendering a megabyte-long (minified JSON) line per diagnostic takes seconds,
                // and a window would make the renderer count columns from the window: state the
                // position alone.
                group.element(
                    Origin::path(loc.origin.as_str())
                        .line(loc.line)
                        .char_column(loc.column),
                )
            } else {
                group.element(snippet(loc, kind, label))
            };
        }
        let mut report: Vec<Group<'_>> = vec![group];
        for note in &self.notes {
            report.push(Group::with_title(
                Level::NOTE.secondary_title(note.as_str()),
            ));
        }
        if let Some(help) = &self.help {
            report.push(Group::with_title(
                Level::HELP.secondary_title(help.as_str()),
            ));
        }
        renderer.render(&report)
    }
}

/// Lines longer than this are not quoted in rendered diagnostics.
const LONG_LINE: usize = 400;

fn snippet<'a>(
    loc: &'a Location,
    kind: AnnotationKind,
    label: &'a str,
) -> Snippet<'a, annotate_snippets::Annotation<'a>> {
    let annotation = kind.span(loc.span_in_line.clone());
    let annotation = if label.is_empty() {
        annotation
    } else {
        annotation.label(label)
    };
    Snippet::source(&*loc.line_text)
        .line_start(loc.line)
        .path(loc.origin.as_str())
        .annotation(annotation)
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(RenderStyle::Plain))
    }
}

/// Maps byte offsets to lines and columns in one source text; built once per file so that
/// thousands of diagnostics on a large file stay cheap.
pub(crate) struct LineIndex<'s> {
    src: &'s str,
    origin: &'s str,
    starts: Vec<usize>,
    /// Lines handed out so far, so that diagnostics on one line share its text.
    lines: RefCell<HashMap<usize, (Arc<str>, bool)>>,
}

impl<'s> LineIndex<'s> {
    pub(crate) fn new(src: &'s str, origin: &'s str) -> Self {
        let starts = std::iter::once(0)
            .chain(src.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        LineIndex {
            src,
            origin,
            starts,
            lines: RefCell::new(HashMap::new()),
        }
    }

    /// The location of a byte range (clamped to the text and to the first line it touches).
    pub(crate) fn locate(&self, span: &Range<usize>) -> Location {
        let start = floor_boundary(self.src, span.start.min(self.src.len()));
        let line0 = self.starts.partition_point(|&s| s <= start) - 1;
        let line_start = self.starts[line0];
        let line_end = self
            .starts
            .get(line0 + 1)
            .map_or(self.src.len(), |&next| next - 1);
        let line_text = self.src[line_start..line_end].trim_end_matches('\r');
        let col_byte = start - line_start;
        let col_byte = col_byte.min(line_text.len());
        let end = span.end.clamp(start, line_start + line_text.len()) - line_start;
        let end = floor_boundary(line_text, end.max(col_byte));
        let (line_text, ascii) = self.shared_line(line0, line_text);
        let column = if ascii {
            col_byte + 1
        } else {
            line_text[..col_byte].chars().count() + 1
        };
        Location {
            origin: self.origin.to_string(),
            line: line0 + 1,
            column,
            line_text,
            span_in_line: col_byte..end,
        }
    }
}

impl LineIndex<'_> {
    /// The shared text of a line and whether it is ASCII (then columns are byte offsets, which
    /// keeps thousands of diagnostics on one long line linear).
    fn shared_line(&self, line0: usize, text: &str) -> (Arc<str>, bool) {
        self.lines
            .borrow_mut()
            .entry(line0)
            .or_insert_with(|| (Arc::from(text), text.is_ascii()))
            .clone()
    }
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locates_lines_and_columns_in_characters() {
        let src = "a = 1\r\né = \"x\"\nlast";
        let idx = LineIndex::new(src, "f.toml");
        let loc = idx.locate(&(src.find('"').unwrap()..src.len()));
        assert_eq!((loc.line, loc.column), (2, 5));
        assert_eq!(&*loc.line_text, "é = \"x\"");
        assert_eq!(&loc.line_text[loc.span_in_line.clone()], "\"x\"");
        let end = idx.locate(&(src.len()..src.len()));
        assert_eq!((end.line, end.column), (3, 5));
    }
}
