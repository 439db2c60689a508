//! Configuration errors: each names the key, the line and the column.

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

use serde_spanned::Spanned;
use toml::de::{DeTable, DeValue};

/// One segment of a key path: a table key or an index into an array.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seg {
    /// A key of a table.
    Key(String),
    /// An element of an array (`[[subsystem]]` number 0, 1, ...).
    Index(usize),
}

/// The path of a key from the top of the file, such as `subsystem[0].namespace[1].nsid`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyPath(pub Vec<Seg>);

impl KeyPath {
    /// The path with one more key.
    pub fn key(&self, k: &str) -> KeyPath {
        let mut v = self.0.clone();
        v.push(Seg::Key(k.to_owned()));
        KeyPath(v)
    }
    /// The path with one more array index.
    pub fn index(&self, i: usize) -> KeyPath {
        let mut v = self.0.clone();
        v.push(Seg::Index(i));
        KeyPath(v)
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) if n == 0 => write!(f, "{k}")?,
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Index(i) => write!(f, "[{i}]")?,
            }
        }
        Ok(())
    }
}

/// One error in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The file, when the configuration was read from one.
    pub file: Option<PathBuf>,
    /// The key in error (`subsystem[0].namespace[1].nsid`); empty for a syntax error between
    /// keys.
    pub key: String,
    /// 1-based line of the key (or of the nearest enclosing table when the key is missing).
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
    /// What is wrong, and what would be right.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}:", file.display())?;
        }
        write!(f, "{}:{}: ", self.line, self.column)?;
        if !self.key.is_empty() {
            write!(f, "`{}`: ", self.key)?;
        }
        f.write_str(&self.message)
    }
}

/// All the errors found in one configuration file, in file order.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, e) in self.0.iter().enumerate() {
            if n > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// 1-based line and column (in characters) of byte offset `pos` in `text`.
pub(crate) fn line_col(text: &str, pos: usize) -> (usize, usize) {
    let pos = pos.min(text.len());
    let pos = (0..=pos)
        .rev()
        .find(|&p| text.is_char_boundary(p))
        .unwrap_or(0);
    let before = &text[..pos];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |p| p + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// The span of `path` in the parsed document: the key itself when it is present, otherwise the
/// nearest enclosing table or array element that is.
pub(crate) fn span_of(doc: &Spanned<DeTable<'_>>, path: &KeyPath) -> Range<usize> {
    let mut best = 0..0;
    let mut cur: Option<&DeValue<'_>> = None;
    let mut table: Option<&DeTable<'_>> = Some(doc.get_ref());
    for seg in &path.0 {
        match seg {
            Seg::Key(k) => {
                let Some(t) = table else { break };
                let Some((key, value)) = t.iter().find(|(key, _)| key.get_ref() == k) else {
                    break;
                };
                best = key.span();
                cur = Some(value.get_ref());
            }
            Seg::Index(i) => {
                let Some(DeValue::Array(a)) = cur else { break };
                let Some(item) = a.get(*i) else { break };
                best = item.span();
                cur = Some(item.get_ref());
            }
        }
        table = match cur {
            Some(DeValue::Table(t)) => Some(t),
            _ => None,
        };
    }
    best
}

/// The path of the deepest key whose key or value contains byte offset `pos`.
///
/// Table spans cover only their header, so every child is searched, not only those of a
/// container that contains `pos`.
pub(crate) fn path_at(doc: &Spanned<DeTable<'_>>, pos: usize) -> KeyPath {
    fn find_in_table(t: &DeTable<'_>, pos: usize) -> Option<Vec<Seg>> {
        for (k, v) in t.iter() {
            let here = k.span().contains(&pos) || v.span().contains(&pos);
            if let Some(mut sub) = find(v.get_ref(), pos) {
                sub.insert(0, Seg::Key(k.get_ref().to_string()));
                return Some(sub);
            }
            if here {
                return Some(vec![Seg::Key(k.get_ref().to_string())]);
            }
        }
        None
    }
    fn find(value: &DeValue<'_>, pos: usize) -> Option<Vec<Seg>> {
        match value {
            DeValue::Table(t) => find_in_table(t, pos),
            DeValue::Array(a) => {
                for (i, item) in a.iter().enumerate() {
                    if let Some(mut sub) = find(item.get_ref(), pos) {
                        sub.insert(0, Seg::Index(i));
                        return Some(sub);
                    }
                    if item.span().contains(&pos) {
                        return Some(vec![Seg::Index(i)]);
                    }
                }
                None
            }
            _ => None,
        }
    }
    KeyPath(find_in_table(doc.get_ref(), pos).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_lines_and_characters() {
        let t = "a = 1\nbé = 2\n";
        assert_eq!(line_col(t, 0), (1, 1));
        assert_eq!(line_col(t, 6), (2, 1));
        assert_eq!(line_col(t, 9), (2, 3)); // after the two-byte é
        assert_eq!(line_col(t, 999), (3, 1));
    }

    #[test]
    fn key_paths_display_like_toml() {
        let p = KeyPath::default()
            .key("subsystem")
            .index(0)
            .key("namespace")
            .index(2)
            .key("nsid");
        assert_eq!(p.to_string(), "subsystem[0].namespace[2].nsid");
    }
}
