//! A small YAML emitter for the state directory's documents.

use super::*;

/// One YAML document (`---` first) for a JSON value: block style, strings double-quoted with
/// JSON escapes (valid YAML), so `"true"` stays a string.
pub(super) fn to_yaml_doc(v: &Value) -> String {
    let mut out = String::from("---\n");
    emit(v, 0, &mut out);
    out
}

/// Can `s` be written as a plain YAML scalar and still read back as the same string, also
/// under YAML 1.1 rules (where `True`, `yes`, `on`, `1_000` and `0x1f` are not strings)?
pub(super) fn plain_ok(s: &str) -> bool {
    const SPECIAL: [&str; 12] = [
        "y", "n", "yes", "no", "on", "off", "true", "false", "null", "~", "nan", "inf",
    ];
    let Some(first) = s.chars().next() else {
        return false;
    };
    s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && first.is_ascii_alphanumeric()
        && !SPECIAL.contains(&s.to_ascii_lowercase().as_str())
        && s.replace('_', "").parse::<f64>().is_err()
        // Digit first: only addresses, prefixes and dotted versions (never a YAML 1.1
        // number, date or base-60 value).
        && (!first.is_ascii_digit() || s.contains('/') || s.matches('.').count() >= 2)
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) if plain_ok(s) => s.clone(),
        Value::String(s) => Value::String(s.clone()).to_string(),
        Value::Array(a) if a.is_empty() => "[]".to_owned(),
        Value::Object(o) if o.is_empty() => "{}".to_owned(),
        other => other.to_string(),
    }
}

fn is_block(v: &Value) -> bool {
    match v {
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => false,
    }
}

fn emit(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(map) => {
            for (k, val) in map {
                let key = if plain_ok(k) {
                    k.clone()
                } else {
                    Value::String(k.clone()).to_string()
                };
                if is_block(val) {
                    out.push_str(&format!("{pad}{key}:\n"));
                    emit(val, indent + 2, out);
                } else {
                    out.push_str(&format!("{pad}{key}: {}\n", scalar(val)));
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                if is_block(item) {
                    // "- " then the first line of the block inline.
                    let mut inner = String::new();
                    emit(item, indent + 2, &mut inner);
                    let inner = inner.trim_start();
                    out.push_str(&format!("{pad}- {inner}"));
                } else {
                    out.push_str(&format!("{pad}- {}\n", scalar(item)));
                }
            }
        }
        other => out.push_str(&format!("{pad}{}\n", scalar(other))),
    }
}
