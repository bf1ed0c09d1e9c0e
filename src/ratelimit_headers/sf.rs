//! Just enough of RFC 8941 (structured fields) for `RateLimit` and `RateLimit-Policy`.

/// A bare item; the values of decimals and byte sequences are not needed.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Bare {
    Int(i64),
    Decimal,
    Str(String),
    Token(String),
    Bytes,
    Bool(bool),
}

impl Bare {
    /// The value of a non-negative integer; `None` for anything else.
    pub(super) fn non_negative(&self) -> Option<u64> {
        match *self {
            Bare::Int(n) => u64::try_from(n).ok(),
            _ => None,
        }
    }
}

/// One member of a list (`item;params`) or a dictionary (`key=item;params`, or
/// `key;params` for a true value, which reads the same as a token list item).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Member {
    pub(super) key: Option<String>,
    pub(super) item: Option<Bare>,
    pub(super) params: Vec<(String, Bare)>,
}

impl Member {
    /// The policy name: a string item, or a token for lenience.
    pub(super) fn name(&self) -> Option<&str> {
        match (&self.key, &self.item) {
            (Some(k), None) => Some(k),
            (None, Some(Bare::Str(s) | Bare::Token(s))) => Some(s),
            _ => None,
        }
    }

    /// A parameter's value; the last one wins when a key repeats (RFC 8941 §3.1.2).
    pub(super) fn param(&self, key: &str) -> Option<&Bare> {
        let mut params = self.params.iter().rev();
        params
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v)
    }
}

/// Parse a list or dictionary; `None` if it is empty or not well formed.
pub(super) fn parse(input: &str) -> Option<Vec<Member>> {
    let mut p = Parser {
        s: input.as_bytes(),
        i: 0,
    };
    let mut members = Vec::new();
    p.skip_ows();
    while !p.at_end() {
        members.push(p.member()?);
        p.skip_ows();
        if p.at_end() {
            break;
        }
        p.expect(b',')?;
        p.skip_ows();
        if p.at_end() {
            return None; // a trailing comma
        }
    }
    (!members.is_empty()).then_some(members)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    fn at_end(&self) -> bool {
        self.i >= self.s.len()
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn bump(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn expect(&mut self, c: u8) -> Option<()> {
        (self.bump()? == c).then_some(())
    }

    /// Consume the bytes `f` accepts and return them; every caller accepts ASCII
    /// only, so they always form a `str`.
    fn skip_while(&mut self, f: impl Fn(u8) -> bool) -> &'a str {
        let s: &'a [u8] = self.s;
        let start = self.i;
        while self.peek().is_some_and(&f) {
            self.i += 1;
        }
        std::str::from_utf8(&s[start..self.i]).unwrap_or("")
    }

    fn skip_ows(&mut self) {
        self.skip_while(|c| c == b' ' || c == b'\t');
    }

    fn member(&mut self) -> Option<Member> {
        let (key, item) = if self.peek()?.is_ascii_alphabetic() || self.peek()? == b'*' {
            // A dictionary key or a token list item: the same characters start both.
            let name = self.skip_while(is_token_char).to_owned();
            if self.peek() == Some(b'=') {
                self.i += 1;
                (Some(name), Some(self.bare()?))
            } else {
                (Some(name), None)
            }
        } else {
            (None, Some(self.bare()?))
        };
        let params = self.params()?;
        Some(Member { key, item, params })
    }

    fn params(&mut self) -> Option<Vec<(String, Bare)>> {
        let mut params = Vec::new();
        loop {
            // RFC 8941 allows no space before `;`; tolerate it, it is unambiguous.
            let before = self.i;
            self.skip_while(|c| c == b' ');
            if self.peek() != Some(b';') {
                self.i = before;
                return Some(params);
            }
            self.i += 1;
            self.skip_while(|c| c == b' ');
            let first = self.peek()?;
            if !(first.is_ascii_alphabetic() || first == b'*') {
                return None;
            }
            let key = self
                .skip_while(|c| c.is_ascii_alphanumeric() || b"_-.*".contains(&c))
                .to_owned();
            let value = if self.peek() == Some(b'=') {
                self.i += 1;
                self.bare()?
            } else {
                Bare::Bool(true)
            };
            params.push((key, value));
        }
    }

    fn bare(&mut self) -> Option<Bare> {
        match self.peek()? {
            b'-' | b'0'..=b'9' => self.number(),
            b'"' => self.string(),
            b':' => {
                self.i += 1;
                self.skip_while(|c| c.is_ascii_alphanumeric() || b"+/=".contains(&c));
                self.expect(b':')?;
                Some(Bare::Bytes)
            }
            b'?' => {
                self.i += 1;
                match self.bump()? {
                    b'0' => Some(Bare::Bool(false)),
                    b'1' => Some(Bare::Bool(true)),
                    _ => None,
                }
            }
            c if c.is_ascii_alphabetic() || c == b'*' => {
                Some(Bare::Token(self.skip_while(is_token_char).to_owned()))
            }
            _ => None,
        }
    }

    /// RFC 8941 §4.2.4: at most 15 integer digits, or 12 + 1 to 3 for a decimal.
    fn number(&mut self) -> Option<Bare> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.i += 1;
        }
        let whole = self.skip_while(|c| c.is_ascii_digit());
        if whole.is_empty() {
            return None;
        }
        if self.peek() == Some(b'.') {
            if whole.len() > 12 {
                return None;
            }
            self.i += 1;
            let frac = self.skip_while(|c| c.is_ascii_digit());
            return (1..=3).contains(&frac.len()).then_some(Bare::Decimal);
        }
        if whole.len() > 15 {
            return None;
        }
        // At most 15 digits: always fits an i64.
        let n: i64 = whole.parse().ok()?;
        Some(Bare::Int(if negative { -n } else { n }))
    }

    fn string(&mut self) -> Option<Bare> {
        self.expect(b'"')?;
        let mut out = String::new();
        loop {
            match self.bump()? {
                b'"' => return Some(Bare::Str(out)),
                b'\\' => match self.bump()? {
                    c @ (b'"' | b'\\') => out.push(char::from(c)),
                    _ => return None,
                },
                c @ 0x20..=0x7e => out.push(char::from(c)),
                _ => return None,
            }
        }
    }
}

/// `tchar / ":" / "/"` (RFC 8941 §3.3.4).
fn is_token_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&c)
}
