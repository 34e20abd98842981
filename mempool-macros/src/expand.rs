//! `#[with_pool]` and `pool_scope!`: the user's body stays as the tokens they wrote; only the
//! guard around it is generated, at the pool expression's span so type errors point there.

use proc_macro2::{Delimiter, Group, Span, TokenStream, TokenTree};
use quote::{quote, quote_spanned, ToTokens};
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Attribute, ReturnType, Signature, Token, Type, Visibility};

use crate::args::{AttrArgs, PoolArgs};

/// A function or method, its body kept as tokens.
pub(crate) struct LightFn {
    attrs: Vec<Attribute>,
    vis: Visibility,
    sig: Signature,
    body: Group,
}

const ITEM_KEYWORDS: [&str; 10] =
    ["struct", "enum", "union", "trait", "impl", "mod", "static", "type", "use", "macro_rules"];

impl Parse for LightFn {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        let fork = input.fork();
        if let Ok(id) = fork.call(syn::Ident::parse_any_kw) {
            let word = id.to_string();
            if ITEM_KEYWORDS.contains(&word.as_str()) || (word == "const" && !is_const_fn(input)) {
                return Err(syn::Error::new(
                    id.span(),
                    format!("#[with_pool] goes on a function or method, not on a `{word}`"),
                ));
            }
            if word == "extern" && !fork.peek(Token![fn]) && !(fork.peek(syn::LitStr) && fork.peek2(Token![fn])) {
                return Err(syn::Error::new(
                    id.span(),
                    "#[with_pool] cannot go on an `extern` block: foreign functions have no Rust body to scope",
                ));
            }
        }
        let sig: Signature = input.parse()?;
        if let Some(c) = &sig.constness {
            return Err(syn::Error::new(
                c.span,
                "#[with_pool] cannot go on a `const fn`: a pool scope is entered and left at run time",
            ));
        }
        if let Some(abi) = &sig.abi {
            return Err(syn::Error::new(
                abi.span(),
                "#[with_pool] cannot go on an `extern` function: callers from other languages cannot see the scope's guard; \
                 scope a Rust function that it calls instead",
            ));
        }
        if input.peek(Token![;]) {
            return Err(input.error("#[with_pool] needs a function with a body"));
        }
        let body: Group = input.parse()?;
        if body.delimiter() != Delimiter::Brace {
            return Err(syn::Error::new(body.span(), "expected the function's body"));
        }
        Ok(LightFn { attrs, vis, sig, body })
    }
}

trait ParseAnyKw {
    fn parse_any_kw(input: ParseStream<'_>) -> syn::Result<syn::Ident>;
}

impl ParseAnyKw for syn::Ident {
    fn parse_any_kw(input: ParseStream<'_>) -> syn::Result<syn::Ident> {
        use syn::ext::IdentExt;
        syn::Ident::parse_any(input)
    }
}

fn is_const_fn(input: ParseStream<'_>) -> bool {
    let fork = input.fork();
    fork.parse::<Token![const]>().is_ok()
        && (fork.peek(Token![fn]) || fork.peek(Token![async]) || fork.peek(Token![unsafe]) || fork.peek(Token![extern]))
}

/// `#[with_pool(..)]`. On bad arguments or a bad item: the item unchanged plus one error.
pub(crate) fn with_pool(attr: TokenStream, item: TokenStream) -> TokenStream {
    let args = match syn::parse2::<AttrArgs>(attr) {
        Ok(AttrArgs(a)) => a,
        Err(e) => return error_with(item, e),
    };
    let f = match syn::parse2::<LightFn>(item.clone()) {
        Ok(f) => f,
        Err(e) => return error_with(item, e),
    };
    expand_fn(args, f)
}

fn error_with(item: TokenStream, e: syn::Error) -> TokenStream {
    let e = e.into_compile_error();
    quote!(#item #e)
}

fn expand_fn(args: PoolArgs, f: LightFn) -> TokenStream {
    let LightFn { attrs, vis, sig, body } = f;
    let krate = args.krate();
    let pool = &args.pool;
    let span = pool.span();
    let take_pool = quote_spanned!(span=> let __mempool_pool = &(#pool););
    let new_body = if sig.asyncness.is_some() {
        let scoped = match &args.stream {
            Some(s) => quote_spanned!(span=> #krate::__private::scoped_fn_on(__mempool_pool, &(#s))),
            None => quote_spanned!(span=> #krate::__private::scoped_fn(__mempool_pool)),
        };
        let wrap = match output_type(&sig) {
            Some(t) => quote!(#krate::__private::wrap::<#t, _>),
            None => quote!(#krate::__private::wrap),
        };
        quote!({
            let __mempool_wrapper = { #take_pool #scoped };
            #wrap(__mempool_wrapper, async move #body).await
        })
    } else {
        let enter = match &args.stream {
            Some(s) => quote_spanned!(span=> #krate::__private::enter_on(__mempool_pool, &(#s))),
            None => quote_spanned!(span=> #krate::__private::enter(__mempool_pool)),
        };
        quote!({
            #take_pool
            let __mempool_scope = #enter;
            #body
        })
    };
    let mut out = TokenStream::new();
    for a in attrs {
        a.to_tokens(&mut out);
    }
    vis.to_tokens(&mut out);
    sig.to_tokens(&mut out);
    out.extend(new_body);
    out
}

/// The declared output type, when it can be named in a turbofish (no `impl Trait`, no `'_`).
fn output_type(sig: &Signature) -> Option<Type> {
    match &sig.output {
        ReturnType::Default => Some(syn::parse_quote!(())),
        ReturnType::Type(_, t) => {
            let s = t.to_token_stream().to_string();
            (!s.contains("impl") && !s.contains("'_") && !s.contains('&')).then(|| (**t).clone())
        }
    }
}

/// `pool_scope!(pool [, stream = s] [, crate = path] => { body })`.
pub(crate) struct ScopeInput {
    args: PoolArgs,
    body: Group,
}

impl Parse for ScopeInput {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let args = PoolArgs::parse_until(input, "pool_scope!", true)?;
        if !input.peek(Token![=>]) {
            return Err(input.error("expected `=>` and a block after the pool: `pool_scope!(my_pool => { ... })`"));
        }
        input.parse::<Token![=>]>()?;
        let tt: TokenTree = input
            .parse()
            .map_err(|e| syn::Error::new(e.span(), "expected a block after `=>`: `pool_scope!(my_pool => { ... })`"))?;
        let body = match tt {
            TokenTree::Group(g) if g.delimiter() == Delimiter::Brace => g,
            other => {
                return Err(syn::Error::new(
                    other.span(),
                    "the body of `pool_scope!` must be a block: `pool_scope!(my_pool => { ... })`",
                ))
            }
        };
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after the block of `pool_scope!`"));
        }
        Ok(ScopeInput { args, body })
    }
}

pub(crate) fn pool_scope(input: TokenStream) -> TokenStream {
    let ScopeInput { args, body } = match syn::parse2::<ScopeInput>(input) {
        Ok(i) => i,
        Err(e) => return e.into_compile_error(),
    };
    let krate = args.krate();
    let pool = &args.pool;
    let span = pool.span();
    let enter = match &args.stream {
        Some(s) => quote_spanned!(span=> #krate::__private::enter_on(__mempool_pool, &(#s))),
        None => quote_spanned!(span=> #krate::__private::enter(__mempool_pool)),
    };
    // The pool is bound first so that a temporary (`&pool`, a call) lives as long as the scope.
    quote!({
        let __mempool_pool = &(#pool);
        let __mempool_scope = #enter;
        #[allow(unused_braces)]
        let __mempool_value = #body;
        __mempool_value
    })
}

/// `begin_pool!` / `end_pool!` outside a `#[pool_scopes]` function.
pub(crate) fn stray(which: &str) -> TokenStream {
    let span = Span::call_site();
    let msg = format!(
        "`{which}!` only works inside a function marked `#[pool_scopes]`, which checks that every \
         `begin_pool!` has its `end_pool!` in the same block; add `#[mempool::pool_scopes]` to the \
         enclosing function, or use `pool_scope!(pool => {{ ... }})`"
    );
    syn::Error::new(span, msg).into_compile_error()
}
