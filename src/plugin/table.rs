//! Columns for a terminal: each as wide as its widest cell, and when the row would
//! not fit the width, the last column (the free text: a message, a reason) is cut
//! with `…` rather than wrapped, so a table stays one line per row on an 80-column
//! terminal. Widths are measured without colour codes (console's ANSI-aware width), so
//! a coloured cell lines up with a plain one.

use console::{Alignment, measure_text_width, pad_str, truncate_str};

/// The width to lay out for: the terminal's when stdout is one, else 80 (what a
/// script or a pipe gets, and what the layout is checked against).
pub fn width() -> usize {
    console::Term::stdout()
        .size_checked()
        .map_or(80, |(_, columns)| usize::from(columns).max(40))
}

/// `rows` under `headers`, two spaces between columns, within `width`.
pub fn render(headers: &[&str], rows: &[Vec<String>], width: usize) -> String {
    let columns = headers.len();
    let mut widths: Vec<usize> = headers.iter().map(|h| measure_text_width(h)).collect();
    for row in rows {
        for (column, cell) in row.iter().enumerate().take(columns) {
            widths[column] = widths[column].max(measure_text_width(cell));
        }
    }
    // What the columns before the last take, with their gaps.
    let fixed: usize = widths[..columns - 1].iter().map(|w| w + 2).sum();
    if let Some(last) = widths.last_mut() {
        *last = (*last).min(width.saturating_sub(fixed).max(8));
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut out = String::new();
        for (column, cell) in cells.enumerate().take(columns) {
            let cell = truncate_str(cell, widths[column], "…");
            if column + 1 == columns {
                out.push_str(&cell);
            } else {
                out.push_str(&pad_str(&cell, widths[column], Alignment::Left, None));
                out.push_str("  ");
            }
        }
        out.trim_end().to_owned()
    };
    let mut out = line(&mut headers.iter().copied());
    out.push('\n');
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
        out.push('\n');
    }
    out
}

/// `text` in the colour of how good it is, when stdout takes colour (a terminal, and
/// no NO_COLOR: console decides).
pub fn good(text: &str, good: bool) -> String {
    if good {
        console::style(text).green().to_string()
    } else {
        console::style(text).red().bold().to_string()
    }
}

/// `text` in a colour that says "look here" (a warning, something in progress).
pub fn notice(text: &str) -> String {
    console::style(text).yellow().to_string()
}

/// `text` as a heading.
pub fn heading(text: &str) -> String {
    console::style(text).bold().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_line_up_and_the_last_is_cut_to_the_width() {
        let rows = vec![
            vec!["Ready".to_owned(), "True".to_owned(), "x".repeat(200)],
            vec![
                "ContinuousArchiving".to_owned(),
                "False".to_owned(),
                "short".to_owned(),
            ],
        ];
        let out = render(&["TYPE", "STATUS", "MESSAGE"], &rows, 80);
        for line in out.lines() {
            assert!(measure_text_width(line) <= 80, "{line:?}");
        }
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0].find("STATUS"), lines[2].find("False"));
        assert!(lines[1].ends_with('…'), "{}", lines[1]);
        assert!(lines[2].ends_with("short"));
    }

    #[test]
    fn colour_codes_do_not_count_as_width() {
        let red = console::style("False")
            .red()
            .force_styling(true)
            .to_string();
        let rows = vec![
            vec!["a".to_owned(), red, "m".to_owned()],
            vec!["b".to_owned(), "True".to_owned(), "m".to_owned()],
        ];
        let out = render(&["T", "STATUS", "M"], &rows, 80);
        let lines: Vec<String> = out
            .lines()
            .map(|l| console::strip_ansi_codes(l).into_owned())
            .collect();
        assert_eq!(lines[1].find('m'), lines[2].find('m'), "{lines:?}");
    }
}
