//! Plain-text tables for `--output table` (`comfy-table`, no borders):
//! aligned columns under a header, and aligned `key  value` lists. On a
//! terminal the tables fit its width (long cells wrap); into a pipe or a
//! file they are never wrapped, so scripts see one line per row. Also the
//! one place that writes to stdout, so a closed pipe (`agq job list X |
//! head`) ends the command quietly.

use std::io::Write;

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
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        let mut cells: Vec<String> = cells.into_iter().map(Into::into).collect();
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
pub fn key_values(pairs: &[(&str, String)]) -> String {
    finish(&key_values_table(pairs))
}

/// The comfy-table of [`key_values`].
fn key_values_table(pairs: &[(&str, String)]) -> comfy_table::Table {
    let rows: Vec<Vec<String>> = pairs
        .iter()
        .map(|(k, v)| vec![(*k).to_owned(), v.clone()])
        .collect();
    let mut t = layout(None, &rows);
    if let Some(c) = t.column_mut(0) {
        c.set_constraint(ColumnConstraint::ContentWidth);
    }
    t
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
    fn aligns_key_values() {
        let text = plain(key_values_table(&[
            ("a", "1".into()),
            ("long", "x\ny".into()),
        ]));
        assert_eq!(text, "a     1\nlong  x\n      y\n");
    }
}
