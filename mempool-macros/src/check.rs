//! `#[pool_scopes]`: explicit `begin_pool!(p);` ... `end_pool!(p);` pairs, checked per block at
//! compile time and turned into guards, so `?`, early returns and panics still end the scope.
//!
//! The function's tokens are walked as they are (nothing is re-parsed or re-printed); each block
//! (`{ ... }`) keeps a stack of open scopes. Every violation is reported, under its own macro call.

use proc_macro2::{Delimiter, Group, Ident, TokenStream, TokenTree};
use quote::{format_ident, quote};
use syn::Path;

use crate::args::{ScopesArgs, StmtArgs};

pub(crate) fn pool_scopes(attr: TokenStream, item: TokenStream) -> TokenStream {
    let krate: Path = match syn::parse2::<ScopesArgs>(attr) {
        Ok(a) => a.krate.unwrap_or_else(|| syn::parse_quote!(::mempool)),
        Err(e) => {
            let e = e.into_compile_error();
            return quote!(#item #e);
        }
    };
    let mut cx = Checker { krate, errors: Vec::new(), next: 0 };
    let out = cx.block(item, &mut Vec::new());
    let errors = cx.errors.into_iter().map(syn::Error::into_compile_error);
    quote!(#out #(#errors)*)
}

/// An open `begin_pool!`.
struct Open {
    pool: String,
    guard: Ident,
    call: TokenStream,
}

/// A `begin_pool!` that a nested block left open, kept to explain an `end_pool!` outside it.
struct Stranded {
    pool: String,
}

struct Checker {
    krate: Path,
    errors: Vec<syn::Error>,
    next: usize,
}

enum Call {
    Begin,
    End,
}

impl Checker {
    /// Transforms the tokens of one block (or the whole item), reporting what stays open in it.
    /// `stranded` collects begins left open in nested blocks, for the enclosing block's messages.
    fn block(&mut self, tokens: TokenStream, stranded_out: &mut Vec<Stranded>) -> TokenStream {
        let tts: Vec<TokenTree> = tokens.into_iter().collect();
        let mut out: Vec<TokenTree> = Vec::new();
        let mut open: Vec<Open> = Vec::new();
        let mut stranded: Vec<Stranded> = Vec::new();
        let mut i = 0;
        while i < tts.len() {
            if let Some((kind, group, consumed)) = macro_call(&tts[i..]) {
                let prefix = strip_path_prefix(&mut out);
                let name = match &tts[i] {
                    TokenTree::Ident(id) => id.clone(),
                    _ => unreachable!("macro_call starts at an identifier"),
                };
                let call: TokenStream = prefix.iter().cloned().chain(tts[i..i + 3].iter().cloned()).collect();
                let checked = match kind {
                    Call::Begin => self.begin(&name, &group, call, &mut open),
                    Call::End => self.end(&group, call, &mut open, &stranded),
                };
                // The checked form goes back through the user's own macro path, so the import
                // is used and `mempool::begin_pool!` stays `mempool::begin_pool!`.
                if let Some(args) = checked {
                    out.extend(prefix);
                    out.push(tts[i].clone());
                    out.push(tts[i + 1].clone());
                    let mut g = Group::new(Delimiter::Parenthesis, args);
                    g.set_span(group.span());
                    out.push(TokenTree::Group(g));
                    out.push(TokenTree::Punct(proc_macro2::Punct::new(';', proc_macro2::Spacing::Alone)));
                }
                i += consumed;
                continue;
            }
            match &tts[i] {
                TokenTree::Group(g) => {
                    let inner = self.block(g.stream(), &mut stranded);
                    let mut ng = Group::new(g.delimiter(), inner);
                    ng.set_span(g.span());
                    out.push(TokenTree::Group(ng));
                }
                other => out.push(other.clone()),
            }
            i += 1;
        }
        for o in open {
            self.errors.push(syn::Error::new_spanned(
                &o.call,
                format!(
                    "`begin_pool!({p})` is never ended in this block: add `end_pool!({p});` before the block ends \
                     (a scope begun in a loop or branch must end there too)",
                    p = o.pool
                ),
            ));
            stranded_out.push(Stranded { pool: o.pool });
        }
        out.into_iter().collect()
    }

    /// The arguments of the checked `begin_pool!` that replaces this one.
    fn begin(&mut self, name: &Ident, group: &Group, call: TokenStream, open: &mut Vec<Open>) -> Option<TokenStream> {
        let args = match syn::parse2::<StmtArgs>(group.stream()) {
            Ok(StmtArgs(a)) => a,
            Err(e) => {
                self.errors.push(e);
                return None;
            }
        };
        if args.krate.is_some() {
            self.errors.push(syn::Error::new_spanned(
                &call,
                "give `crate = <path>` to `#[pool_scopes(crate = ...)]`, not to `begin_pool!`",
            ));
        }
        self.next += 1;
        let guard = format_ident!("__mempool_scope_{}", self.next, span = name.span());
        let pool = &args.pool;
        let krate = &self.krate;
        open.push(Open { pool: normalized(pool), guard: guard.clone(), call });
        let stream = args.stream.as_ref().map(|s| quote!(, stream = #s));
        Some(quote!(@checked #guard, #krate, #pool #stream))
    }

    /// The arguments of the checked `end_pool!` that replaces this one.
    fn end(
        &mut self,
        group: &Group,
        call: TokenStream,
        open: &mut Vec<Open>,
        stranded: &[Stranded],
    ) -> Option<TokenStream> {
        let args = match syn::parse2::<StmtArgs>(group.stream()) {
            Ok(StmtArgs(a)) => a,
            Err(e) => {
                self.errors.push(e);
                return None;
            }
        };
        if args.stream.is_some() || args.krate.is_some() {
            self.errors.push(syn::Error::new_spanned(
                &call,
                "`end_pool!` takes only the pool; the stream belongs to `begin_pool!`",
            ));
        }
        let pool = normalized(&args.pool);
        match open.last() {
            Some(top) if top.pool == pool => {
                let guard = open.pop().map(|o| o.guard).expect("checked");
                Some(quote!(@checked #guard))
            }
            Some(top) => {
                let msg = if open.iter().any(|o| o.pool == pool) {
                    format!(
                        "`end_pool!({pool})` must end the innermost open scope first, `begin_pool!({})`: \
                         scopes nest, so end them in the reverse order",
                        top.pool
                    )
                } else {
                    format!(
                        "`end_pool!({pool})` names another pool than the innermost open scope, `begin_pool!({})`",
                        top.pool
                    )
                };
                self.errors.push(syn::Error::new_spanned(&call, msg));
                None
            }
            None => {
                let msg = match stranded.iter().find(|s| s.pool == pool) {
                    Some(_) => format!(
                        "`end_pool!({pool})` ends a scope begun inside a nested block: a scope begun in a loop or \
                         branch must end in that same block"
                    ),
                    None => format!("`end_pool!({pool})` has no matching `begin_pool!({pool})` earlier in this block"),
                };
                self.errors.push(syn::Error::new_spanned(&call, msg));
                None
            }
        }
    }
}

/// `begin_pool ! ( .. ) ;` or `end_pool ! ( .. ) ;` at the start of `tts`: which, its arguments,
/// and how many token trees it spans.
fn macro_call(tts: &[TokenTree]) -> Option<(Call, Group, usize)> {
    let kind = match tts.first()? {
        TokenTree::Ident(id) if id == "begin_pool" => Call::Begin,
        TokenTree::Ident(id) if id == "end_pool" => Call::End,
        _ => return None,
    };
    match (tts.get(1)?, tts.get(2)?) {
        (TokenTree::Punct(p), TokenTree::Group(g)) if p.as_char() == '!' && g.delimiter() != Delimiter::Brace => {
            let semi = matches!(tts.get(3), Some(TokenTree::Punct(p)) if p.as_char() == ';');
            Some((kind, g.clone(), if semi { 4 } else { 3 }))
        }
        _ => None,
    }
}

/// Removes a `mempool::` / `::mempool::` path just emitted before a macro name; returns it.
fn strip_path_prefix(out: &mut Vec<TokenTree>) -> Vec<TokenTree> {
    let mut taken = Vec::new();
    loop {
        let n = out.len();
        let is_colons = n >= 2
            && matches!((&out[n - 2], &out[n - 1]), (TokenTree::Punct(a), TokenTree::Punct(b)) if a.as_char() == ':' && b.as_char() == ':');
        if !is_colons {
            break;
        }
        let colons = [out[n - 2].clone(), out[n - 1].clone()];
        out.truncate(n - 2);
        let seg = match out.last() {
            Some(TokenTree::Ident(_)) => out.pop(),
            _ => None,
        };
        taken.splice(0..0, seg.into_iter().chain(colons));
    }
    taken
}

fn normalized(e: &syn::Expr) -> String {
    quote!(#e).to_string()
}

/// `begin_pool!(@checked guard, krate, pool [, stream = s])`, as `#[pool_scopes]` rewrites it.
struct CheckedBegin {
    guard: Ident,
    krate: syn::Path,
    args: crate::args::PoolArgs,
}

impl syn::parse::Parse for CheckedBegin {
    fn parse(input: syn::parse::ParseStream<'_>) -> syn::Result<Self> {
        input.parse::<syn::Token![@]>()?;
        input.parse::<Ident>()?;
        let guard = input.parse()?;
        input.parse::<syn::Token![,]>()?;
        let krate = input.parse()?;
        input.parse::<syn::Token![,]>()?;
        let args = crate::args::PoolArgs::parse_until(input, "begin_pool!", false)?;
        Ok(CheckedBegin { guard, krate, args })
    }
}

/// Whether the input is the checked form `#[pool_scopes]` writes.
pub(crate) fn is_checked(input: &TokenStream) -> bool {
    matches!(input.clone().into_iter().next(), Some(TokenTree::Punct(p)) if p.as_char() == '@')
}

/// `begin_pool!(@checked ..)`: the guard.
pub(crate) fn checked_begin(input: TokenStream) -> TokenStream {
    use syn::spanned::Spanned;
    let CheckedBegin { guard, krate, args } = match syn::parse2(input) {
        Ok(c) => c,
        Err(e) => return e.into_compile_error(),
    };
    let pool = &args.pool;
    let span = pool.span();
    let binding = format_ident!("{}_pool", guard);
    let enter = match &args.stream {
        Some(s) => quote::quote_spanned!(span=> #krate::__private::enter_on(#binding, &(#s))),
        None => quote::quote_spanned!(span=> #krate::__private::enter(#binding)),
    };
    quote!(let #binding = &(#pool); let #guard = #enter;)
}

/// `end_pool!(@checked guard)`: the guard's end.
pub(crate) fn checked_end(input: TokenStream) -> TokenStream {
    let guard = input.into_iter().nth(2);
    quote!(::core::mem::drop(#guard);)
}
