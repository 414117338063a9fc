//! The chat template of a checkpoint, rendered the way `transformers`'
//! `apply_chat_template` renders it.
//!
//! `transformers` compiles `tokenizer_config.json`'s `chat_template` with Jinja2
//! (`trim_blocks` and `lstrip_blocks` on, the `loopcontrols` extension) and gives it
//! `messages`, `add_generation_prompt` and the special tokens, the globals
//! `raise_exception` and `strftime_now`, and its own `tojson` filter. Here the
//! template goes through `minijinja` set up the same way, with
//! `minijinja-contrib`'s Python string and dict methods (`.strip()`,
//! `.startswith()`, `.items()`, …), which Jinja2 gets from Python itself.
//!
//! What differs: a dict built inside a template keeps its keys in sorted order,
//! where Python keeps insertion order (a message keeps `role`, `content`);
//! `strftime_now` formats a fixed date (see [`ChatTemplate::with_date`]); the
//! `{% generation %}` tag of assistant-mask templates is not supported.

use crate::error::{Error, Result};
use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// The name the template is compiled under, which minijinja's errors quote.
const NAME: &str = "chat_template";

/// One turn of a conversation: `role` is `system`, `user`, `assistant` or whatever
/// else the template knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message { role: role.into(), content: content.into() }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A message as the template sees it: a dict with `role` then `content`, in that
/// order (as Python's dict literal keeps them) for `items()` and `tojson`.
impl Object for Message {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(Value::from(self.role.as_str())),
            "content" => Some(Value::from(self.content.as_str())),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

/// The message of a template's `raise_exception(msg)`, carried as the source of
/// minijinja's error so that [`ChatTemplate::apply`] can tell it from a failure of
/// the template itself.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// A compiled chat template with the special tokens it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// The date `strftime_now` formats unless [`ChatTemplate::with_date`] sets another:
/// the one Llama-3.1's template falls back to when the function is missing, so a
/// prompt renders the same with or without it.
pub const DEFAULT_DATE: (i32, u32, u32) = (2024, 7, 26);

fn bad_config(m: impl fmt::Display) -> Error {
    Error::Checkpoint(format!("tokenizer_config.json: {m}"))
}

impl ChatTemplate {
    /// Compiles `source`; the tokens are given to it as `bos_token` and `eos_token`
    /// where present (undefined otherwise, which prints as nothing).
    pub fn new(source: impl Into<String>, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        // Jinja2's settings in transformers; a trailing newline is dropped, as Jinja2
        // does by default.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| Error::Checkpoint(format!("`{NAME}`: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
        });
        env.add_filter("tojson", tojson);
        let source = source.into();
        env.add_template_owned(NAME, source.clone()).map_err(|e| Error::Checkpoint(format!("`{NAME}`: {e}")))?;
        Ok(ChatTemplate { env, source, bos_token, eos_token }.with_date(DEFAULT_DATE.0, DEFAULT_DATE.1, DEFAULT_DATE.2))
    }

    /// The date (proleptic Gregorian, at midnight) that `strftime_now(fmt)` formats.
    /// A fixed date keeps a rendered prompt reproducible; pass today's to get what
    /// `transformers` would render today.
    pub fn with_date(mut self, year: i32, month: u32, day: u32) -> Self {
        self.env.add_function("strftime_now", move |fmt: String| strftime(&fmt, year, month, day));
        self
    }

    /// Reads the text of a `tokenizer_config.json`: `chat_template` (a string, or a
    /// list of `{name, template}` from which `default` is taken, else the first)
    /// and `bos_token` / `eos_token` (a string, or an added-token object with a
    /// `content`). `None` when there is no template.
    pub fn from_tokenizer_config(json: &str) -> Result<Option<Self>> {
        let config: serde_json::Value = serde_json::from_str(json).map_err(bad_config)?;
        let Some(source) = template_source(&config)? else {
            return Ok(None);
        };
        let (bos, eos) = special_tokens(&config)?;
        Self::new(source, bos, eos).map(Some).map_err(|e| match e {
            Error::Checkpoint(m) => bad_config(m),
            e => e,
        })
    }

    /// `bos_token` and `eos_token` of the text of a `tokenizer_config.json`, for a
    /// template kept in a file of its own.
    pub(crate) fn special_tokens_of(json: &str) -> Result<(Option<String>, Option<String>)> {
        special_tokens(&serde_json::from_str(json).map_err(bad_config)?)
    }

    /// [`from_tokenizer_config`](Self::from_tokenizer_config) on a file.
    pub fn from_file(path: &Path) -> Result<Option<Self>> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?;
        Self::from_tokenizer_config(&text)
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders the conversation; `add_generation_prompt` asks the template to end
    /// with the header of an assistant turn. A template's `raise_exception(msg)` is
    /// an [`Error::Checkpoint`] that quotes `msg`.
    pub fn apply(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let messages: Vec<Value> = messages.iter().map(|m| Value::from_object(m.clone())).collect();
        let mut context = std::collections::BTreeMap::new();
        context.insert("messages", Value::from(messages));
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));
        if let Some(t) = &self.bos_token {
            context.insert("bos_token", Value::from(t.as_str()));
        }
        if let Some(t) = &self.eos_token {
            context.insert("eos_token", Value::from(t.as_str()));
        }
        let template = self.env.get_template(NAME).map_err(|e| Error::Checkpoint(format!("`{NAME}`: {e}")))?;
        template.render(Value::from(context)).map_err(|e| {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(s) = source {
                if let Some(Raised(msg)) = s.downcast_ref::<Raised>() {
                    return Error::Checkpoint(format!("`{NAME}` raised an exception: {msg}"));
                }
                source = s.source();
            }
            Error::Checkpoint(format!("`{NAME}`: {e}"))
        })
    }
}

/// `chat_template` of a parsed `tokenizer_config.json`, if it has one.
fn template_source(config: &serde_json::Value) -> Result<Option<String>> {
    use serde_json::Value as J;
    match config.get("chat_template") {
        None | Some(J::Null) => Ok(None),
        Some(J::String(s)) => Ok(Some(s.clone())),
        Some(J::Array(list)) => {
            let named =
                |name: Option<&str>| list.iter().find(|t| name.is_none() || t.get("name").and_then(J::as_str) == name);
            let Some(entry) = named(Some("default")).or_else(|| named(None)) else {
                return Ok(None);
            };
            match entry.get("template") {
                Some(J::String(s)) => Ok(Some(s.clone())),
                _ => Err(bad_config("`chat_template`: an entry of the list has no `template` string")),
            }
        }
        Some(_) => Err(bad_config("`chat_template` is neither a string nor a list of `{name, template}`")),
    }
}

/// `bos_token` and `eos_token` of a parsed `tokenizer_config.json`.
fn special_tokens(config: &serde_json::Value) -> Result<(Option<String>, Option<String>)> {
    use serde_json::Value as J;
    let token = |field: &str| match config.get(field) {
        None | Some(J::Null) => Ok(None),
        Some(J::String(s)) => Ok(Some(s.clone())),
        Some(J::Object(o)) => match o.get("content") {
            Some(J::String(s)) => Ok(Some(s.clone())),
            _ => Err(bad_config(format!("`{field}` has no `content` string"))),
        },
        Some(_) => Err(bad_config(format!("`{field}` is neither a string nor a token object"))),
    };
    Ok((token("bos_token")?, token("eos_token")?))
}

/// `transformers`' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: Python's `json.dumps`, which leaves `<`, `>` and `&` alone
/// (minijinja's own `tojson` escapes them for HTML).
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => " ".repeat(usize::try_from(v)?),
        }),
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "separators must be a pair")),
        // json.dumps: ", " between items, but "," when indenting.
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    kwargs.assert_all_used()?;
    let json = Json { indent, item: separators.0, key: separators.1, ensure_ascii, sort_keys };
    let mut out = String::new();
    json.write(&mut out, value, 0)?;
    Ok(Value::from_safe_string(out))
}

struct Json {
    indent: Option<String>,
    item: String,
    key: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl Json {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, out: &mut String, value: &Value, depth: usize) -> std::result::Result<(), minijinja::Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
            ValueKind::Number => out.push_str(&python_float(f64::try_from(value.clone())?)),
            ValueKind::String => self.string(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container(out, '[', ']', &items, depth, |out, item| self.write(out, item, depth + 1))?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.container(out, '{', '}', &keys, depth, |out, key| {
                    match key.as_str() {
                        Some(k) => self.string(out, k),
                        // Python turns number and bool keys into strings.
                        None => self.string(out, &key.to_string()),
                    }
                    out.push_str(&self.key);
                    self.write(out, &value.get_item(key)?, depth + 1)
                })?;
            }
            kind => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a value of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn container(
        &self,
        out: &mut String,
        open: char,
        close: char,
        items: &[Value],
        depth: usize,
        mut each: impl FnMut(&mut String, &Value) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        if !items.is_empty() {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&self.item);
                }
                self.newline(out, depth + 1);
                each(out, item)?;
            }
            self.newline(out, depth);
        }
        out.push(close);
        Ok(())
    }

    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A float as Python's `repr` writes it: `1.0`, `0.5`, `1e+16`, `1e-07`, `NaN`.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's Debug is the shortest round-trip form, with an exponent exactly where
    // Python's repr has one; only the exponent's spelling differs.
    let s = format!("{x:?}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

fn is_leap(year: i32) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

/// Day of the week, 0 = Sunday (Sakamoto's method).
fn weekday(year: i32, month: u32, day: u32) -> usize {
    const T: [i32; 12] = [0, 3, 2, 5, 0, 3, 5, 1, 4, 6, 2, 4];
    let y = if month < 3 { year - 1 } else { year };
    (y + y.div_euclid(4) - y.div_euclid(100) + y.div_euclid(400) + T[month as usize - 1] + day as i32).rem_euclid(7)
        as usize
}

/// C's `strftime` for midnight of a date, in the C locale, for the directives
/// templates use; any other `%x` is copied as it is.
fn strftime(fmt: &str, year: i32, month: u32, day: u32) -> std::result::Result<String, minijinja::Error> {
    if !(1..=12).contains(&month) || day == 0 || day > 31 {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {year}-{month}-{day} is not a date"),
        ));
    }
    let wd = weekday(year, month, day);
    let month_name = MONTHS[month as usize - 1];
    let days_before: u32 = [31, if is_leap(year) { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
        [..month as usize - 1]
        .iter()
        .sum();
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('a') => out.push_str(&WEEKDAYS[wd][..3]),
            Some('A') => out.push_str(WEEKDAYS[wd]),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('Y') => out.push_str(&year.to_string()),
            Some('j') => out.push_str(&format!("{:03}", days_before + day)),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            Some('H') | Some('M') | Some('S') => out.push_str("00"),
            Some('I') => out.push_str("12"),
            Some('p') => out.push_str("AM"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_the_fixed_date() {
        assert_eq!(strftime("%d %b %Y", 2024, 7, 26).unwrap(), "26 Jul 2024");
        assert_eq!(strftime("%A %B %e, %y (%j) %H:%M %%", 2024, 7, 26).unwrap(), "Friday July 26, 24 (208) 00:00 %");
        assert_eq!(weekday(2000, 1, 1), 6);
        assert_eq!(weekday(2024, 2, 29), 4);
    }

    #[test]
    fn python_floats() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(0.5), "0.5");
        assert_eq!(python_float(1e16), "1e+16");
        assert_eq!(python_float(1e-7), "1e-07");
        assert_eq!(python_float(-2.5e-10), "-2.5e-10");
    }

    #[test]
    fn tojson_matches_json_dumps() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }} {{ {'b': [1, 2.0, none, true], 'a': '<é\"\n>'} | tojson }} \
             {{ [1, {'k': 'v'}] | tojson(indent=2) }} {{ 'é' | tojson(ensure_ascii=true) }}",
            None,
            None,
        )
        .unwrap();
        let out = t.apply(&[Message::user("hi")], false).unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \"hi\"} {\"a\": \"<é\\\"\\n>\", \"b\": [1, 2.0, null, true]} \
             [\n  1,\n  {\n    \"k\": \"v\"\n  }\n] \"\\u00e9\""
        );
    }

    #[test]
    fn python_methods_loop_controls_and_strftime() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role.startswith('sys') %}{% continue %}{% endif %}\
             {{ m.role.title() }}: {{ m.content.strip() }}|{% endfor %}{{ strftime_now('%d %b %Y') }}",
            None,
            None,
        )
        .unwrap();
        let out = t.apply(&[Message::system("s"), Message::user("  hi  ")], false).unwrap();
        assert_eq!(out, "User: hi|26 Jul 2024");
        let t = t.with_date(2025, 1, 2);
        assert_eq!(t.apply(&[], false).unwrap(), "02 Jan 2025");
    }

    #[test]
    fn template_lists_and_token_objects() {
        let json = r#"{
            "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "tools"},
                              {"name": "default", "template": "{{ bos_token }}x{{ eos_token }}"}]
        }"#;
        let t = ChatTemplate::from_tokenizer_config(json).unwrap().unwrap();
        assert_eq!(t.apply(&[], false).unwrap(), "<s>x</s>");
        let first = r#"{"chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]}"#;
        assert_eq!(ChatTemplate::from_tokenizer_config(first).unwrap().unwrap().source(), "A");
        let bad = r#"{"chat_template": "x", "eos_token": 3}"#;
        let m = ChatTemplate::from_tokenizer_config(bad).unwrap_err().to_string();
        assert!(m.contains("tokenizer_config.json") && m.contains("eos_token"), "{m}");
        let bad = r#"{"chat_template": 7}"#;
        let m = ChatTemplate::from_tokenizer_config(bad).unwrap_err().to_string();
        assert!(m.contains("chat_template"), "{m}");
    }
}
