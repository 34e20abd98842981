//! Arguments: `pool_expr` first, then `stream = expr` and `crate = path`, each at most once.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::{Expr, Path, Token};

const VALID: &str = "valid arguments: the pool expression first, then `stream = <expr>`, `crate = <path>`";

/// What `#[with_pool(..)]`, `pool_scope!(.. => ..)` and `begin_pool!(..)` take.
pub(crate) struct PoolArgs {
    pub pool: Expr,
    pub stream: Option<Expr>,
    pub krate: Option<Path>,
}

impl PoolArgs {
    /// The path to the runtime crate: `::mempool` unless `crate = path` says otherwise.
    pub(crate) fn krate(&self) -> Path {
        self.krate.clone().unwrap_or_else(|| syn::parse_quote!(::mempool))
    }
}

/// `ident =` (not `==`) ahead: a named argument.
fn named_ahead(input: ParseStream<'_>) -> bool {
    let fork = input.fork();
    let name = if fork.peek(Token![crate]) {
        fork.parse::<Token![crate]>().is_ok()
    } else {
        fork.parse::<syn::Ident>().is_ok()
    };
    name && fork.peek(Token![=]) && !fork.peek(Token![==]) && !fork.peek(Token![=>])
}

impl PoolArgs {
    /// Parses the arguments up to the end of `input`, or up to `=>` when `stop_at_arrow`.
    pub(crate) fn parse_until(input: ParseStream<'_>, what: &str, stop_at_arrow: bool) -> syn::Result<PoolArgs> {
        let done = |input: ParseStream<'_>| input.is_empty() || (stop_at_arrow && input.peek(Token![=>]));
        if done(input) {
            return Err(syn::Error::new(
                Span::call_site(),
                format!("{what} needs the pool to use: `{}`", example(what)),
            ));
        }
        if named_ahead(input) {
            return Err(input.error(format!("the pool expression comes first: `{}`; {VALID}", example(what))));
        }
        // No struct literals: `pool { .. }` is a pool followed by a block, not a struct.
        let pool = Expr::parse_without_eager_brace(input)?;
        let mut args = PoolArgs { pool, stream: None, krate: None };
        while !done(input) {
            if !input.peek(Token![,]) {
                return Err(input.error(if stop_at_arrow {
                    "expected `=>` and a block after the pool: `pool_scope!(my_pool => { ... })`".to_string()
                } else {
                    format!("expected `,` and a named argument after the pool; {VALID}")
                }));
            }
            input.parse::<Token![,]>()?;
            if done(input) {
                break;
            }
            if input.peek(Token![crate]) {
                let kw: Token![crate] = input.parse()?;
                input.parse::<Token![=]>()?;
                let path: Path = input.parse()?;
                if args.krate.is_some() {
                    return Err(syn::Error::new(kw.span, "duplicate `crate` argument: give the crate's path once"));
                }
                args.krate = Some(path);
                continue;
            }
            let name: syn::Ident = input
                .parse()
                .map_err(|e| syn::Error::new(e.span(), format!("expected a named argument after the pool; {VALID}")))?;
            if name == "stream" {
                input.parse::<Token![=]>()?;
                let e: Expr = input.parse()?;
                if args.stream.is_some() {
                    return Err(syn::Error::new(name.span(), "duplicate `stream` argument: a scope routes one stream"));
                }
                args.stream = Some(e);
            } else {
                return Err(syn::Error::new(name.span(), format!("unknown argument `{name}`; {VALID}")));
            }
        }
        Ok(args)
    }
}

fn example(what: &str) -> String {
    match what {
        "#[with_pool]" => "#[with_pool(my_pool)]".into(),
        "pool_scope!" => "pool_scope!(my_pool => { ... })".into(),
        other => format!("{}(my_pool)", other.trim_end_matches("(..)")),
    }
}

/// `#[with_pool(..)]`'s arguments (everything).
pub(crate) struct AttrArgs(pub PoolArgs);

impl Parse for AttrArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        PoolArgs::parse_until(input, "#[with_pool]", false).map(AttrArgs)
    }
}

/// `begin_pool!(..)` / `end_pool!(..)`'s arguments.
pub(crate) struct StmtArgs(pub PoolArgs);

impl Parse for StmtArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        PoolArgs::parse_until(input, "begin_pool!", false).map(StmtArgs)
    }
}

/// `#[pool_scopes]` / `#[pool_scopes(crate = path)]`.
pub(crate) struct ScopesArgs {
    pub krate: Option<Path>,
}

impl Parse for ScopesArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        if input.is_empty() {
            return Ok(ScopesArgs { krate: None });
        }
        if !input.peek(Token![crate]) {
            return Err(input.error("unexpected argument: `#[pool_scopes]` takes only `crate = <path>`"));
        }
        input.parse::<Token![crate]>()?;
        input.parse::<Token![=]>()?;
        let krate = input.parse()?;
        if !input.is_empty() {
            return Err(input.error("unexpected argument: `#[pool_scopes]` takes only `crate = <path>`"));
        }
        Ok(ScopesArgs { krate: Some(krate) })
    }
}
