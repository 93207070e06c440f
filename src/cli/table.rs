//! Plain-text tables for `--output table`: aligned columns under a header,
//! and aligned `key  value` lists. Also the one place that writes to stdout,
//! so a closed pipe (`agq job list X | head`) ends the command quietly.

use std::io::Write;

use super::CliError;

/// Columns under an upper-case header, each as wide as its widest cell.
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

    /// True when no row was added.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text, one line per row, ending with a newline.
    pub fn render(&self) -> String {
        let width = |s: &str| s.chars().count();
        let mut widths: Vec<usize> = self.header.iter().map(|h| width(h)).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(width(cell));
            }
        }
        let mut out = String::new();
        for line in std::iter::once(&self.header).chain(&self.rows) {
            let mut text = String::new();
            for (i, (cell, w)) in line.iter().zip(&widths).enumerate() {
                if i + 1 == line.len() {
                    text.push_str(cell);
                } else {
                    text.push_str(cell);
                    text.push_str(&" ".repeat(w - width(cell) + 2));
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `key  value` lines with the values aligned; multi-line values continue
/// indented under their first line.
pub fn key_values(pairs: &[(&str, String)]) -> String {
    let w = pairs
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for (k, v) in pairs {
        let pad = " ".repeat(w - k.chars().count() + 2);
        let indent = " ".repeat(w + 2);
        let mut lines = v.lines();
        out.push_str(&format!("{k}{pad}{}\n", lines.next().unwrap_or("")));
        for l in lines {
            out.push_str(&format!("{indent}{l}\n"));
        }
    }
    out
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

    #[test]
    fn aligns_columns() {
        let mut t = Table::new(["ID", "STATUS", "NOTE"]);
        t.row(["a", "completed", ""]);
        t.row(["long-id", "dead", "x"]);
        assert_eq!(
            t.render(),
            "ID       STATUS     NOTE\na        completed\nlong-id  dead       x\n"
        );
    }

    #[test]
    fn aligns_key_values() {
        let text = key_values(&[("a", "1".into()), ("long", "x\ny".into())]);
        assert_eq!(text, "a     1\nlong  x\n      y\n");
    }
}
