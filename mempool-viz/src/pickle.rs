//! A pickle reader of our own, for snapshots of any size and from any source.
//!
//! Python's pickler shares objects through its memo: PyTorch's snapshots hand the same frame
//! list, the same dictionary, the same string to many entries, and a container can even hold
//! itself. A reader that copies each memo reference into a tree cannot read real snapshots (and
//! a large one would multiply in memory). Here every container lives once in an arena and is
//! referred to by index, so a shared object costs one slot however often it is referenced, a
//! cycle is just an index pointing back, and the consumer walks only the paths it knows.
//!
//! Bounded by construction: the machine is a loop over opcodes with an explicit stack (no
//! recursion, so deep nesting cannot overflow the thread's stack); every declared length is
//! checked against the bytes that remain before anything is allocated; each opcode consumes at
//! least one byte and adds at most one value, so memory is linear in the input's size. Any
//! malformed input is an error naming the opcode and its offset; nothing panics.

use std::collections::HashMap;

/// A value on the machine's stack, in the memo, or in a container. Containers and strings are
/// indices into the [`Pickle`]'s arenas, so a value is small and `Copy`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer too wide for 64 bits (its magnitude is not kept).
    BigInt,
    Float(f64),
    Str(u32),
    Bytes(u32),
    List(u32),
    Tuple(u32),
    Dict(u32),
    Set(u32),
    /// An instance of a class (`GLOBAL` + `REDUCE` and friends): kept opaque.
    Object,
}

enum Obj {
    Seq(Vec<Value>),
    Dict(Vec<(Value, Value)>),
}

/// A decoded pickle: its root value and the arenas the values index.
pub(crate) struct Pickle {
    pub(crate) root: Value,
    objs: Vec<Obj>,
    /// Large dictionaries' keys, indexed on first lookup.
    index: std::cell::RefCell<HashMap<u32, HashMap<Box<str>, Value>>>,
    strs: Vec<Box<str>>,
    bytes: Vec<Box<[u8]>>,
}

/// Dictionaries up to this many entries are scanned; larger ones are indexed.
const SCAN_LIMIT: usize = 32;

/// Why a pickle could not be read.
#[derive(Debug)]
pub(crate) struct PickleError(pub String);

impl std::fmt::Display for PickleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

// Memo indices below `2 × puts so far + this` live in a vector, others in a map (a hostile
// `LONG_BINPUT 4000000000`, or puts stepping far apart, must not allocate gigabytes).
const MEMO_DENSE_SLACK: usize = 1 << 10;

enum Slot {
    Value(Value),
    Mark,
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    op_at: usize,
    op: u8,
    stack: Vec<Slot>,
    memo: Vec<Option<Value>>,
    memo_sparse: HashMap<u64, Value>,
    /// Memo operations so far, and distinct slots set (Python numbers `MEMOIZE` by the latter).
    puts: u64,
    memo_count: u64,
    out: Pickle,
}

impl Pickle {
    /// Decodes `data`.
    pub(crate) fn parse(data: &[u8]) -> Result<Pickle, PickleError> {
        let mut m = Machine {
            data,
            pos: 0,
            op_at: 0,
            op: 0,
            stack: Vec::new(),
            memo: Vec::new(),
            memo_sparse: HashMap::new(),
            puts: 0,
            memo_count: 0,
            out: Pickle {
                root: Value::None,
                objs: Vec::new(),
                index: Default::default(),
                strs: Vec::new(),
                bytes: Vec::new(),
            },
        };
        m.run()?;
        Ok(m.out)
    }

    /// The string a value holds (`str`, or `bytes` read as UTF-8 lossily is not done here).
    pub(crate) fn str(&self, v: Value) -> Option<&str> {
        match v {
            Value::Str(i) => self.strs.get(i as usize).map(|s| &**s),
            _ => None,
        }
    }

    /// The bytes a `bytes` value holds.
    pub(crate) fn bytes(&self, v: Value) -> Option<&[u8]> {
        match v {
            Value::Bytes(i) => self.bytes.get(i as usize).map(|s| &**s),
            _ => None,
        }
    }

    /// The items of a list, tuple or set; empty for anything else.
    pub(crate) fn items(&self, v: Value) -> &[Value] {
        match v {
            Value::List(i) | Value::Tuple(i) | Value::Set(i) => match self.objs.get(i as usize) {
                Some(Obj::Seq(s)) => s,
                _ => &[],
            },
            _ => &[],
        }
    }

    /// The entries of a dictionary in insertion order; empty for anything else.
    pub(crate) fn entries(&self, v: Value) -> &[(Value, Value)] {
        match v {
            Value::Dict(i) => match self.objs.get(i as usize) {
                Some(Obj::Dict(d)) => d,
                _ => &[],
            },
            _ => &[],
        }
    }

    /// `d[key]` for a dictionary with string keys (the last setting wins, as in Python). A
    /// small dictionary (a snapshot's have a dozen keys) is scanned; a large one is indexed once,
    /// so reading stays linear even when one large dictionary is shared by every entry.
    pub(crate) fn get(&self, d: Value, key: &str) -> Option<Value> {
        let entries = self.entries(d);
        if entries.len() <= SCAN_LIMIT {
            return entries.iter().rev().find(|(k, _)| self.str(*k) == Some(key)).map(|(_, v)| *v);
        }
        let Value::Dict(id) = d else { return None };
        let mut index = self.index.borrow_mut();
        let map = index.entry(id).or_insert_with(|| {
            let mut m = HashMap::with_capacity(entries.len());
            for (k, v) in entries {
                if let Some(k) = self.str(*k) {
                    m.insert(Box::<str>::from(k), *v);
                }
            }
            m
        });
        map.get(key).copied()
    }

    /// A non-negative integer (floats truncated, booleans 0/1); `None` for anything else.
    pub(crate) fn uint(&self, v: Value) -> Option<u64> {
        match v {
            Value::Int(i) => Some(i.max(0) as u64),
            Value::Bool(b) => Some(b as u64),
            Value::Float(f) if f.is_finite() && f >= 0.0 => Some(f as u64),
            _ => None,
        }
    }

    /// The text of a `str` or (lossily) a `bytes` value.
    pub(crate) fn text(&self, v: Value) -> Option<std::borrow::Cow<'_, str>> {
        if let Some(s) = self.str(v) {
            return Some(s.into());
        }
        self.bytes(v).map(String::from_utf8_lossy)
    }

    /// Whether `v` is a dictionary.
    pub(crate) fn is_dict(&self, v: Value) -> bool {
        matches!(v, Value::Dict(_))
    }
}

impl Machine<'_> {
    fn err(&self, what: impl std::fmt::Display) -> PickleError {
        PickleError(format!("{what} (opcode 0x{:02x} at byte {})", self.op, self.op_at))
    }

    fn take(&mut self, n: u64) -> Result<&[u8], PickleError> {
        let left = (self.data.len() - self.pos) as u64;
        if n > left {
            return Err(self.err(format_args!("declares {n} bytes, only {left} are left")));
        }
        let s = &self.data[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn uint_le(&mut self, n: usize) -> Result<u64, PickleError> {
        let b = self.take(n as u64)?;
        Ok(b.iter().rev().fold(0u64, |acc, x| (acc << 8) | *x as u64))
    }

    fn line(&mut self) -> Result<&[u8], PickleError> {
        let rest = &self.data[self.pos..];
        match rest.iter().position(|b| *b == b'\n') {
            Some(n) => {
                self.pos += n + 1;
                Ok(&rest[..n])
            }
            None => Err(self.err("a text argument without its end of line")),
        }
    }

    fn line_str(&mut self) -> Result<String, PickleError> {
        let l = self.line()?;
        Ok(String::from_utf8_lossy(l).trim_end_matches('\r').to_string())
    }

    fn push(&mut self, v: Value) {
        self.stack.push(Slot::Value(v));
    }

    fn pop(&mut self) -> Result<Value, PickleError> {
        match self.stack.pop() {
            Some(Slot::Value(v)) => Ok(v),
            Some(Slot::Mark) => Err(self.err("a mark where a value was expected")),
            None => Err(self.err("the stack is empty")),
        }
    }

    fn top(&self) -> Result<Value, PickleError> {
        match self.stack.last() {
            Some(Slot::Value(v)) => Ok(*v),
            Some(Slot::Mark) => Err(self.err("a mark where a value was expected")),
            None => Err(self.err("the stack is empty")),
        }
    }

    /// The values above the topmost mark, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Value>, PickleError> {
        let Some(at) = self.stack.iter().rposition(|s| matches!(s, Slot::Mark)) else {
            return Err(self.err("no mark on the stack"));
        };
        let vals = self
            .stack
            .drain(at + 1..)
            .map(|s| match s {
                Slot::Value(v) => v,
                Slot::Mark => Value::None,
            })
            .collect();
        self.stack.pop();
        Ok(vals)
    }

    fn new_obj(&mut self, o: Obj) -> Result<u32, PickleError> {
        let i = u32::try_from(self.out.objs.len()).map_err(|_| self.err("too many objects"))?;
        self.out.objs.push(o);
        Ok(i)
    }

    fn new_str(&mut self, s: String) -> Result<Value, PickleError> {
        let i = u32::try_from(self.out.strs.len()).map_err(|_| self.err("too many strings"))?;
        self.out.strs.push(s.into_boxed_str());
        Ok(Value::Str(i))
    }

    fn new_bytes(&mut self, n: u64) -> Result<Value, PickleError> {
        let b: Box<[u8]> = self.take(n)?.into();
        let i = u32::try_from(self.out.bytes.len()).map_err(|_| self.err("too many byte strings"))?;
        self.out.bytes.push(b);
        Ok(Value::Bytes(i))
    }

    fn utf8(&mut self, n: u64) -> Result<Value, PickleError> {
        let b = self.take(n)?;
        // Python writes lone surrogates with 'surrogatepass'; read them lossily.
        let s = String::from_utf8_lossy(b).into_owned();
        self.new_str(s)
    }

    fn seq_of(&mut self, v: Value) -> Result<u32, PickleError> {
        match v {
            Value::List(i) | Value::Set(i) => Ok(i),
            _ => Err(self.err("appending to something that is not a list or set")),
        }
    }

    fn extend(&mut self, target: Value, vals: Vec<Value>) -> Result<(), PickleError> {
        let i = self.seq_of(target)?;
        match self.out.objs.get_mut(i as usize) {
            Some(Obj::Seq(s)) => {
                s.extend(vals);
                Ok(())
            }
            _ => Err(self.err("appending to something that is not a list or set")),
        }
    }

    fn set_items(&mut self, target: Value, vals: Vec<Value>) -> Result<(), PickleError> {
        if vals.len() % 2 != 0 {
            return Err(self.err("an odd number of values for key/value pairs"));
        }
        let Value::Dict(i) = target else {
            // `BUILD`/`SETITEMS` on an opaque object's state: dropped.
            if target == Value::Object {
                return Ok(());
            }
            return Err(self.err("setting items on something that is not a dictionary"));
        };
        match self.out.objs.get_mut(i as usize) {
            Some(Obj::Dict(d)) => {
                d.extend(vals.chunks_exact(2).map(|kv| (kv[0], kv[1])));
                Ok(())
            }
            _ => Err(self.err("setting items on something that is not a dictionary")),
        }
    }

    fn memo_put(&mut self, idx: u64, v: Value) {
        self.puts += 1;
        // Dense while the index stays within a bound of the puts made so far (each costs at
        // least a byte of input): memory stays linear in the input however the indices step.
        let bound = self.puts.saturating_mul(2).saturating_add(MEMO_DENSE_SLACK as u64);
        let fresh = if idx < bound && usize::try_from(idx).is_ok() {
            let i = idx as usize;
            if i >= self.memo.len() {
                self.memo.resize(i + 1, None);
            }
            self.memo[i].replace(v).is_none()
        } else {
            self.memo_sparse.insert(idx, v).is_none()
        };
        if fresh {
            self.memo_count += 1;
        }
    }

    fn memo_get(&mut self, idx: u64) -> Result<(), PickleError> {
        let v = usize::try_from(idx)
            .ok()
            .and_then(|i| self.memo.get(i).copied().flatten())
            .or_else(|| self.memo_sparse.get(&idx).copied());
        match v {
            Some(v) => {
                self.push(v);
                Ok(())
            }
            None => Err(self.err(format_args!("memo slot {idx} was never set"))),
        }
    }

    fn int_from_le(b: &[u8]) -> Value {
        if b.len() > 8 {
            return Value::BigInt;
        }
        let mut buf = if b.last().is_some_and(|x| x & 0x80 != 0) { [0xffu8; 8] } else { [0u8; 8] };
        buf[..b.len()].copy_from_slice(b);
        Value::Int(i64::from_le_bytes(buf))
    }

    fn tuple(&mut self, vals: Vec<Value>) -> Result<(), PickleError> {
        let i = self.new_obj(Obj::Seq(vals))?;
        self.push(Value::Tuple(i));
        Ok(())
    }

    fn run(&mut self) -> Result<(), PickleError> {
        loop {
            self.op_at = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                return Err(PickleError(format!("the pickle ends at byte {} without its STOP", self.pos)));
            };
            self.op = op;
            self.pos += 1;
            match op {
                b'.' => {
                    self.out.root = self.pop()?;
                    return Ok(());
                }
                0x80 => {
                    let p = self.uint_le(1)?;
                    if p > 5 {
                        return Err(self.err(format_args!("pickle protocol {p} is newer than 5")));
                    }
                }
                0x95 => {
                    self.uint_le(8)?;
                }
                b'(' => self.stack.push(Slot::Mark),
                b'0' => {
                    self.stack.pop().ok_or_else(|| self.err("the stack is empty"))?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?;
                    self.push(v);
                }
                b'N' => self.push(Value::None),
                0x88 => self.push(Value::Bool(true)),
                0x89 => self.push(Value::Bool(false)),
                b'I' => {
                    let l = self.line_str()?;
                    let v = match l.as_str() {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        s => Value::Int(s.parse().map_err(|_| self.err(format_args!("bad INT {s:?}")))?),
                    };
                    self.push(v);
                }
                b'L' => {
                    let l = self.line_str()?;
                    let s = l.trim_end_matches('L');
                    let v = s.parse::<i64>().map(Value::Int).or_else(|_| {
                        if !s.is_empty() && s.trim_start_matches('-').bytes().all(|b| b.is_ascii_digit()) {
                            Ok(Value::BigInt)
                        } else {
                            Err(self.err(format_args!("bad LONG {s:?}")))
                        }
                    })?;
                    self.push(v);
                }
                b'J' => {
                    let b = self.take(4)?;
                    let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    self.push(Value::Int(v as i64));
                }
                b'K' => {
                    let v = self.uint_le(1)?;
                    self.push(Value::Int(v as i64));
                }
                b'M' => {
                    let v = self.uint_le(2)?;
                    self.push(Value::Int(v as i64));
                }
                0x8a | 0x8b => {
                    let n = self.uint_le(if op == 0x8a { 1 } else { 4 })?;
                    let b = self.take(n)?;
                    let v = Machine::int_from_le(b);
                    self.push(v);
                }
                b'F' => {
                    let l = self.line_str()?;
                    let f = l.parse().map_err(|_| self.err(format_args!("bad FLOAT {l:?}")))?;
                    self.push(Value::Float(f));
                }
                b'G' => {
                    let b = self.take(8)?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    self.push(Value::Float(f64::from_be_bytes(a)));
                }
                b'S' => {
                    let l = self.line_str()?;
                    let s = l.trim();
                    let inner = ['\'', '"']
                        .iter()
                        .find_map(|q| s.strip_prefix(*q).and_then(|r| r.strip_suffix(*q)))
                        .ok_or_else(|| self.err("a STRING without its quotes"))?
                        .to_string();
                    let v = self.new_str(inner)?;
                    self.push(v);
                }
                b'V' => {
                    let l = self.line_str()?;
                    let v = self.new_str(l)?;
                    self.push(v);
                }
                b'T' | b'X' | b'U' | 0x8c | 0x8d => {
                    let n = match op {
                        b'T' | b'X' => self.uint_le(4)?,
                        b'U' | 0x8c => self.uint_le(1)?,
                        _ => self.uint_le(8)?,
                    };
                    let v = self.utf8(n)?;
                    self.push(v);
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    let n = match op {
                        b'B' => self.uint_le(4)?,
                        b'C' => self.uint_le(1)?,
                        _ => self.uint_le(8)?,
                    };
                    let v = self.new_bytes(n)?;
                    self.push(v);
                }
                b']' => {
                    let i = self.new_obj(Obj::Seq(Vec::new()))?;
                    self.push(Value::List(i));
                }
                b'l' => {
                    let vals = self.pop_mark()?;
                    let i = self.new_obj(Obj::Seq(vals))?;
                    self.push(Value::List(i));
                }
                b'a' => {
                    let v = self.pop()?;
                    let t = self.top()?;
                    self.extend(t, vec![v])?;
                }
                b'e' | 0x90 => {
                    let vals = self.pop_mark()?;
                    let t = self.top()?;
                    self.extend(t, vals)?;
                }
                b')' => self.tuple(Vec::new())?,
                b't' => {
                    let vals = self.pop_mark()?;
                    self.tuple(vals)?;
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut vals = Vec::with_capacity(n);
                    for _ in 0..n {
                        vals.push(self.pop()?);
                    }
                    vals.reverse();
                    self.tuple(vals)?;
                }
                b'}' => {
                    let i = self.new_obj(Obj::Dict(Vec::new()))?;
                    self.push(Value::Dict(i));
                }
                b'd' => {
                    let vals = self.pop_mark()?;
                    let i = self.new_obj(Obj::Dict(Vec::new()))?;
                    self.set_items(Value::Dict(i), vals)?;
                    self.push(Value::Dict(i));
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let t = self.top()?;
                    self.set_items(t, vec![k, v])?;
                }
                b'u' => {
                    let vals = self.pop_mark()?;
                    let t = self.top()?;
                    self.set_items(t, vals)?;
                }
                0x8f => {
                    let i = self.new_obj(Obj::Seq(Vec::new()))?;
                    self.push(Value::Set(i));
                }
                0x91 => {
                    let vals = self.pop_mark()?;
                    let i = self.new_obj(Obj::Seq(vals))?;
                    self.push(Value::Set(i));
                }
                b'g' => {
                    let l = self.line_str()?;
                    let i = l.parse().map_err(|_| self.err(format_args!("bad GET {l:?}")))?;
                    self.memo_get(i)?;
                }
                b'h' => {
                    let i = self.uint_le(1)?;
                    self.memo_get(i)?;
                }
                b'j' => {
                    let i = self.uint_le(4)?;
                    self.memo_get(i)?;
                }
                b'p' | b'q' | b'r' | 0x94 => {
                    let idx = match op {
                        b'p' => {
                            let l = self.line_str()?;
                            l.parse().map_err(|_| self.err(format_args!("bad PUT {l:?}")))?
                        }
                        b'q' => self.uint_le(1)?,
                        b'r' => self.uint_le(4)?,
                        _ => self.memo_count,
                    };
                    let v = self.top()?;
                    self.memo_put(idx, v);
                }
                // Classes and their instances: read past them, keep an opaque value.
                b'c' => {
                    self.line()?;
                    self.line()?;
                    self.push(Value::Object);
                }
                0x93 => {
                    self.pop()?;
                    self.pop()?;
                    self.push(Value::Object);
                }
                b'R' | 0x81 => {
                    self.pop()?;
                    self.pop()?;
                    self.push(Value::Object);
                }
                0x92 => {
                    self.pop()?;
                    self.pop()?;
                    self.pop()?;
                    self.push(Value::Object);
                }
                b'b' => {
                    // BUILD: an object's state. Objects are opaque here, so the state is dropped
                    // (merging a dict's state into a dict would let a few bytes double memory).
                    self.pop()?;
                    self.top()?;
                }
                b'i' => {
                    self.line()?;
                    self.line()?;
                    self.pop_mark()?;
                    self.push(Value::Object);
                }
                b'o' => {
                    self.pop_mark()?;
                    self.push(Value::Object);
                }
                _ => return Err(self.err("an opcode this reader does not know (or not a pickle)")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_that_holds_itself_is_read() {
        // l = []; l.append(l); pickle.dumps(l, 2)
        let p = Pickle::parse(b"\x80\x02]q\x00h\x00a.").unwrap();
        let Value::List(i) = p.root else { panic!("not a list") };
        assert_eq!(p.items(p.root), &[Value::List(i)]);
    }

    #[test]
    fn huge_declared_lengths_are_refused_before_allocating() {
        let e = Pickle::parse(b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7f.").err().unwrap();
        assert!(e.0.contains("declares"), "{e}");
        // A memo slot far away goes to the sparse map (no 4 GiB vector); an unset one is an error.
        let e = Pickle::parse(b"\x80\x04]r\xff\xff\xff\xffh\x07.").err().unwrap();
        assert!(e.0.contains("memo slot 7"), "{e}");
    }

    #[test]
    fn deep_nesting_does_not_recurse() {
        let mut b = b"\x80\x02".to_vec();
        b.extend(std::iter::repeat_n(b']', 1_000_000));
        b.extend(std::iter::repeat_n(b'a', 999_999));
        b.push(b'.');
        let p = Pickle::parse(&b).unwrap();
        assert_eq!(p.items(p.root).len(), 1);
    }
}
