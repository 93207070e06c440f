//! Plain-text tables for `--output table` (`comfy-table`, no borders):
//! aligned columns under a header, and aligned `key  value` lists. On a
//! terminal the tables fit its width (long cells wrap); into a pipe or a
//! file they are never wrapped, so scripts see one line per row. Also the
//! one place that writes to stdout, so a closed pipe (`agq job list X |
//! head`) ends the command quietly.
//!
//! Much of what the tables show was written by someone else (job inputs,
//! task output, error texts, plan descriptions, what workers report), so
//! every cell and value is passed through [`visible`] or
//! [`visible_lines`]: a control character (an escape sequence, a carriage
//! return, a backspace) or a BiDi override reaches the terminal as text
//! (`\x1b`, `\r`, `\u{202e}`), never as a command to it.

use std::{borrow::Cow, io::Write};

use comfy_table::{presets::NOTHING, ColumnConstraint, ContentArrangement};

use super::CliError;

/// Columns under an upper-case header, each as wide as its widest cell
/// (display width, so wide and combining characters line up), two spaces
/// apart.
#[derive(Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row; missing cells are empty, extra cells are dropped.
    /// Each cell is shown through [`visible`], so a row stays one line and
    /// writes no terminal control.
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        let mut cells: Vec<String> = cells
            .into_iter()
            .map(|c| visible(&c.into()).into_owned())
            .collect();
        cells.resize(self.header.len(), String::new());
        self.rows.push(cells);
    }

    /// The table as text, one line per row (more where a cell wraps on a
    /// terminal), ending with a newline.
    pub fn render(&self) -> String {
        finish(&self.comfy())
    }

    /// The comfy-table of this table.
    fn comfy(&self) -> comfy_table::Table {
        let mut t = layout(Some(&self.header), &self.rows);
        // Ids in the first column are never broken across lines.
        if let Some(c) = t.column_mut(0) {
            c.set_constraint(ColumnConstraint::ContentWidth);
        }
        t
    }
}

/// A borderless table of `rows` (under `header` when given): columns two
/// spaces apart, laid out to the terminal's width when stdout is one.
fn layout(header: Option<&[String]>, rows: &[Vec<String>]) -> comfy_table::Table {
    let mut t = comfy_table::Table::new();
    t.load_style(NOTHING)
        .set_content_arrangement(ContentArrangement::Dynamic);
    if let Some(h) = header {
        t.set_header(h.iter().map(String::as_str));
    }
    for r in rows {
        t.add_row(r.iter().map(String::as_str));
    }
    let n = t.column_count();
    for (i, c) in t.column_iter_mut().enumerate() {
        c.set_padding((0, if i + 1 == n { 0 } else { 2 }));
    }
    t
}

/// The lines of `t` without trailing blanks, each ending with a newline.
fn finish(t: &comfy_table::Table) -> String {
    t.lines().map(|l| l.trim_end().to_owned() + "\n").collect()
}

/// `key  value` lines with the values aligned; multi-line values continue
/// indented under their first line (and long ones wrap there on a terminal).
/// Values are shown through [`visible_lines`].
pub fn key_values(pairs: &[(&str, String)]) -> String {
    finish(&key_values_table(pairs))
}

/// The comfy-table of [`key_values`].
fn key_values_table(pairs: &[(&str, String)]) -> comfy_table::Table {
    let rows: Vec<Vec<String>> = pairs
        .iter()
        .map(|(k, v)| vec![(*k).to_owned(), visible_lines(v).into_owned()])
        .collect();
    let mut t = layout(None, &rows);
    if let Some(c) = t.column_mut(0) {
        c.set_constraint(ColumnConstraint::ContentWidth);
    }
    t
}

/// `s` with every character that would act on a terminal instead of being
/// shown written as text: control characters (C0, DEL and C1: escape
/// sequences, carriage returns, backspaces, bells, line breaks, tabs) as
/// `\n`, `\t`, `\r` or `\xNN` (`\x1b`, `\x7f`, `\x9b`), and the Unicode
/// BiDi controls, which reorder what follows them on the line, as
/// `\u{202e}`. Everything else, backslashes included, is kept as it is.
pub fn visible(s: &str) -> Cow<'_, str> {
    escape_controls(s, false)
}

/// [`visible`], but line breaks and tabs are kept: for text shown as
/// lines (a task's output, a multi-line value).
pub fn visible_lines(s: &str) -> Cow<'_, str> {
    escape_controls(s, true)
}

/// The BiDi controls: embeddings, overrides, isolates and marks.
fn is_bidi_control(c: char) -> bool {
    matches!(
        c,
        '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
    )
}

fn escape_controls(s: &str, keep_lines: bool) -> Cow<'_, str> {
    let escaped = |c: char| {
        (c.is_control() && !(keep_lines && (c == '\n' || c == '\t'))) || is_bidi_control(c)
    };
    if !s.chars().any(escaped) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if !escaped(c) {
            out.push(c);
            continue;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) <= 0xff => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
        }
    }
    Cow::Owned(out)
}

/// Writes `text` to stdout.
///
/// # Errors
///
/// [`CliError::BrokenPipe`] when the reader went away, [`CliError::Output`]
/// for any other write error.
pub fn emit(text: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => CliError::BrokenPipe,
            _ => CliError::Output(e.to_string()),
        })
}

/// Writes `text` and a newline to stdout (see [`emit`]).
///
/// # Errors
///
/// As [`emit`].
pub fn emit_line(text: &str) -> Result<(), CliError> {
    let mut s = String::with_capacity(text.len() + 1);
    s.push_str(text);
    s.push('\n');
    emit(&s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `t` rendered as into a pipe: no terminal, no width.
    fn plain(mut t: comfy_table::Table) -> String {
        t.force_no_tty();
        finish(&t)
    }

    #[test]
    fn aligns_columns() {
        let mut t = Table::new(["ID", "STATUS", "NOTE"]);
        t.row(["a", "completed", ""]);
        t.row(["long-id", "dead", "x"]);
        assert_eq!(
            plain(t.comfy()),
            "ID       STATUS     NOTE\na        completed\nlong-id  dead       x\n"
        );
    }

    #[test]
    fn aligns_by_display_width() {
        let mut t = Table::new(["NAME", "N"]);
        t.row(["日本", "1"]);
        t.row(["ab", "2"]);
        assert_eq!(plain(t.comfy()), "NAME  N\n日本  1\nab    2\n");
    }

    #[test]
    fn never_wraps_without_a_terminal() {
        let long = "word ".repeat(60);
        let mut t = Table::new(["ID", "NOTE"]);
        t.row(["a", long.trim_end()]);
        let text = plain(t.comfy());
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(
            text.ends_with(&format!("a   {}\n", long.trim_end())),
            "{text}"
        );
    }

    #[test]
    fn fits_a_terminal_width_keeping_ids_whole() {
        let mut t = Table::new(["ID", "NOTE"]);
        t.row(["a-long-job-id", &"word ".repeat(20)]);
        let mut c = t.comfy();
        c.set_width(40);
        let text = finish(&c);
        assert!(text.lines().count() > 2, "{text}");
        for l in text.lines() {
            assert!(l.chars().count() <= 40, "{l:?} in\n{text}");
        }
        assert!(text.contains("a-long-job-id  word"), "{text}");
    }

    #[test]
    fn control_characters_and_bidi_overrides_are_shown_not_obeyed() {
        assert_eq!(visible("plain ümlaut \\x1b"), "plain ümlaut \\x1b");
        assert!(matches!(visible("plain"), Cow::Borrowed(_)));
        assert_eq!(
            visible("a\x1b]52;c;QQ==\x07b\rc\x08\x7f\u{9b}\u{202e}d\n\t"),
            "a\\x1b]52;c;QQ==\\x07b\\rc\\x08\\x7f\\x9b\\u{202e}d\\n\\t"
        );
        assert_eq!(
            visible_lines("x\ty\n\x1b[2Jz\r\n\u{2066}"),
            "x\ty\n\\x1b[2Jz\\r\n\\u{2066}"
        );
        let mut t = Table::new(["ID", "NOTE"]);
        t.row(["a", "line\nnext\x1b[31m"]);
        assert_eq!(plain(t.comfy()), "ID  NOTE\na   line\\nnext\\x1b[31m\n");
        let kv = plain(key_values_table(&[(
            "error",
            "x\x1b]0;title\x07\ny".into(),
        )]));
        assert_eq!(kv, "error  x\\x1b]0;title\\x07\n       y\n");
    }

    #[test]
    fn aligns_key_values() {
        let text = plain(key_values_table(&[
            ("a", "1".into()),
            ("long", "x\ny".into()),
        ]));
        assert_eq!(text, "a     1\nlong  x\n      y\n");
    }
}
