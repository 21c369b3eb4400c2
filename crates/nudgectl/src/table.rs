//! Aligned text tables for the operator's terminal (`trace`, `dlq`): columns as wide as their
//! widest cell, numbers right-aligned, no trailing spaces.

use std::io::Write;

/// How a column's cells line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Align {
    Left,
    Right,
}

/// Writes `rows` under `columns` (header, alignment), each line starting with `indent`.
pub(crate) fn write_table(
    out: &mut impl Write,
    indent: &str,
    columns: &[(&str, Align)],
    rows: &[Vec<String>],
) -> std::io::Result<()> {
    let mut widths: Vec<usize> = columns.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header: Vec<String> = columns.iter().map(|(h, _)| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::from(indent);
        for (i, ((cell, width), (_, align))) in row.iter().zip(&widths).zip(columns).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let pad = width.saturating_sub(cell.chars().count());
            match align {
                Align::Left => {
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                }
                Align::Right => {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                }
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn columns_are_as_wide_as_their_widest_cell_and_numbers_line_up_right() {
        let mut out = Vec::new();
        write_table(
            &mut out,
            "  ",
            &[("reason", Align::Left), ("n", Align::Right)],
            &[
                vec!["http_400".into(), "12".into()],
                vec!["x".into(), "3".into()],
            ],
        )
        .unwrap();

        assert_eq!(
            String::from_utf8(out).unwrap(),
            "  reason     n\n  http_400  12\n  x          3\n"
        );
    }
}
