//! The floor: the claim and the completion as the plainest statements that
//! keep the contract (the scope's policy, lease stamped from the clock,
//! retention from the lease's end, the fence, the response limit, and the
//! same answer rows: every claim column and `lease_live`), which the SQL
//! functions are measured against; and the check that holds them to the
//! migrations.

/// The floor's claim: one statement that reads the scope's policy, stamps
/// the lease and the retention from the clock, inserts a free key carrying
/// no work (so it is in no re-drive index), and
/// answers the row as `agent.idempotency_claim` does (`outcome`, every claim
/// column, `lease_live`). Binds `$1` the tenant, `$2` the key, `$3` the
/// request hash, `$4` the lease token; the scope is `tool.bench`, the lease
/// 60 s. The tests below hold it against the migrations' claim.
pub(super) const FLOOR_CLAIM: &str = "with p as (select s.retain from agent.idempotency_scopes s
             where s.scope = 'tool.bench'
                or (s.scope like '%.*'
                    and char_length('tool.bench') > char_length(s.scope) - 1
                    and left('tool.bench', char_length(s.scope) - 1) = left(s.scope, -1))
             order by s.scope = 'tool.bench' desc, char_length(s.scope) desc limit 1),
      c as (select clock_timestamp() as at)
 insert into agent.idempotency_keys as k
   (organization_id, scope, key, request_hash, status, lease_token,
    claimed_at, lease_expires_at, retain_until, request, redrive_at, traceparent)
 select $1, 'tool.bench', $2, $3, 'processing', $4,
        c.at, c.at + interval '60 seconds', c.at + interval '60 seconds' + p.retain, null, null, null
   from p, c
 on conflict (organization_id, scope, key) do nothing
 returning 'claimed' as outcome, k.id, k.organization_id, k.scope, k.key, k.request_hash,
           k.status, k.lease_token, k.resource_type, k.resource_id, k.response,
           k.claimed_at, k.lease_expires_at, k.retain_until,
           k.lease_expires_at > clock_timestamp() as lease_live, k.traceparent";

/// The floor's completion: one statement that completes a claim the caller
/// holds (the fence), with a response its scope's limit admits, and answers
/// the row as `agent.idempotency_complete` does. Binds `$1` the claim, `$2`
/// the lease token, `$3` the claim's organization, `$4` the response. The
/// tests below hold it against the migrations' completion.
pub(super) const FLOOR_COMPLETE: &str = "update agent.idempotency_keys as k
    set status = 'completed', response = $4,
        request = case when $4 -> 'ok' = 'false'::jsonb then k.request end,
        retain_until = greatest(k.retain_until, clock_timestamp() + (k.retain_until - k.lease_expires_at)),
        redrive_at = null
  where k.organization_id = $3 and k.id = $1 and k.lease_token = $2 and k.status = 'processing'
    and octet_length($4::text) <= (
          select s.max_response_bytes from agent.idempotency_scopes s
           where s.scope = k.scope
              or (s.scope like '%.*'
                  and char_length(k.scope) > char_length(s.scope) - 1
                  and left(k.scope, char_length(s.scope) - 1) = left(s.scope, -1))
           order by s.scope = k.scope desc, char_length(s.scope) desc limit 1)
 returning k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
           k.lease_token, k.resource_type, k.resource_id, k.response, k.claimed_at,
           k.lease_expires_at, k.retain_until, false as lease_live";

/// The floor against the migrations: the statements that decide what a claim
/// and a completion do, read from the latest definitions among the embedded
/// migrations and compared token by token with the floor's, after renaming
/// the functions' parameters and variables to what the floor binds. Every
/// place the floor may differ is a row of a substitution table below, with
/// its reason; any other difference fails.
#[cfg(test)]
mod tests {
    use idempotency_plane::migrations::MIGRATIONS;

    use super::{FLOOR_CLAIM, FLOOR_COMPLETE};

    /// SQL as tokens: words and numbers lowercased, quoted literals and
    /// identifiers whole, `$n` whole, a run of operator characters as one,
    /// any other character alone; whitespace and `--` comments dropped, and
    /// the `pg_catalog.` qualifier too (the functions run with an empty
    /// search_path, the floor with the default one).
    fn tokens(sql: &str) -> Vec<String> {
        const OPERATOR: &str = "<>=!~+-*/%|&^:";
        let chars: Vec<char> = sql.chars().collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            let start = i;
            if c.is_whitespace() {
                i += 1;
                continue;
            }
            if c == '-' && chars.get(i + 1) == Some(&'-') {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            if c == '\'' || c == '"' {
                i += 1;
                while i < chars.len() {
                    if chars[i] == c && chars.get(i + 1) == Some(&c) {
                        i += 2;
                    } else if chars[i] == c {
                        i += 1;
                        break;
                    } else {
                        i += 1;
                    }
                }
                out.push(chars[start..i].iter().collect());
                continue;
            }
            if c == '$' || c.is_alphanumeric() || c == '_' {
                i += 1;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                out.push(chars[start..i].iter().collect::<String>().to_lowercase());
                continue;
            }
            if OPERATOR.contains(c) {
                while i < chars.len() && OPERATOR.contains(chars[i]) && !(chars[i] == '-' && i > start) {
                    i += 1;
                }
                out.push(chars[start..i].iter().collect());
                continue;
            }
            out.push(c.to_string());
            i += 1;
        }
        let mut unqualified: Vec<String> = Vec::with_capacity(out.len());
        let mut j = 0;
        while j < out.len() {
            if out[j] == "pg_catalog" && out.get(j + 1).is_some_and(|t| t == ".") {
                j += 2;
                continue;
            }
            unqualified.push(out[j].clone());
            j += 1;
        }
        unqualified
    }

    /// Where `needle` starts in `haystack`, at or after `from`.
    fn find(haystack: &[String], needle: &[String], from: usize) -> Option<usize> {
        (from..=haystack.len().saturating_sub(needle.len())).find(|&at| haystack[at..].starts_with(needle))
    }

    /// The tokens of `sql` from the first `from` through the first `through`
    /// after it, both included.
    fn span(sql: &[String], from: &str, through: &str) -> Vec<String> {
        let (from_tokens, through_tokens) = (tokens(from), tokens(through));
        let start = find(sql, &from_tokens, 0).unwrap_or_else(|| panic!("no `{from}` in {}", sql.join(" ")));
        let end = find(sql, &through_tokens, start + from_tokens.len())
            .unwrap_or_else(|| panic!("no `{through}` after `{from}` in {}", sql.join(" ")));
        sql[start..end + through_tokens.len()].to_vec()
    }

    /// `sql` with every occurrence of each left side replaced by its right
    /// side, in the table's order.
    fn substitute(sql: Vec<String>, table: &[(&str, &str, &str)]) -> Vec<String> {
        table.iter().fold(sql, |sql, (function, floor, _why)| {
            let (from, to) = (tokens(function), tokens(floor));
            let mut out = Vec::with_capacity(sql.len());
            let mut i = 0;
            while i < sql.len() {
                if sql[i..].starts_with(&from) {
                    out.extend(to.iter().cloned());
                    i += from.len();
                } else {
                    out.push(sql[i].clone());
                    i += 1;
                }
            }
            out
        })
    }

    /// The text of the latest `create` of `agent.<name>` (a function or a
    /// type) among the embedded migrations, from `create` to the end of its
    /// definition (a function's closing `$$`, a type's `);`), and its file.
    /// Panics when none creates it, or when a drop of it comes last.
    fn latest(kind: &str, name: &str) -> (&'static str, &'static str) {
        let named = |sql: &str, at: usize, prefix: &str| {
            matches!(sql[at + prefix.len()..].chars().next(), Some('(' | ' ' | ';'))
        };
        let mut last = None;
        for (file, sql) in MIGRATIONS {
            let lower = sql.to_ascii_lowercase();
            let mut events = Vec::new();
            for (prefix, creates) in [
                (format!("create {kind} agent.{name}"), true),
                (format!("create or replace {kind} agent.{name}"), true),
                (format!("drop {kind} agent.{name}"), false),
            ] {
                let found = lower.match_indices(&prefix).map(|(at, _)| at).filter(|&at| named(&lower, at, &prefix));
                events.extend(found.map(|at| (at, creates)));
            }
            if let Some(&(at, creates)) = events.iter().max() {
                last = Some((*file, *sql, at, creates));
            }
        }
        let Some((file, sql, at, creates)) = last else { panic!("no migration creates {kind} agent.{name}") };
        assert!(creates, "{file} drops {kind} agent.{name} after its latest definition");
        let rest = &sql[at..];
        let end = if kind == "function" {
            // The body's dollar quote: `$$`, `$_$` as pg_dump writes one
            // whose body holds `$$` (a declared-schema file copied whole),
            // or `$function$` as Supabase's diff writes every body (a
            // drafted migration).
            let quote = ["$$", "$_$", "$function$"]
                .into_iter()
                .filter_map(|quote| rest.find(quote).map(|at| (at, quote)))
                .min()
                .expect("a function body");
            let body = quote.0 + quote.1.len();
            body + rest[body..].find(quote.1).expect("the end of the body") + quote.1.len()
        } else {
            rest.find(");").expect("the end of the type") + 2
        };
        (file, &rest[..end])
    }

    /// The names of a composite type's fields, in order.
    fn type_fields(definition: &str) -> Vec<String> {
        let open = definition.find('(').expect("the fields");
        let fields = &definition[open + 1..definition.rfind(')').expect("the fields' end")];
        fields.split(',').map(|field| tokens(field)[0].clone()).collect()
    }

    /// The attributes `alter type agent.<name> add attribute` adds, in the
    /// order the migrations add them (a drafted migration quotes its names).
    fn added_attributes(name: &str) -> Vec<String> {
        let prefix = format!("alter type agent.{name} add attribute ");
        MIGRATIONS
            .iter()
            .flat_map(|(_, sql)| {
                let lower = sql.to_ascii_lowercase().replace('"', "");
                lower
                    .match_indices(&prefix)
                    .map(|(at, _)| tokens(&lower[at + prefix.len()..])[0].clone())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The names of the columns a statement's `returning` list answers: an
    /// `as` alias, else the column after the last `.`.
    fn returning_names(sql: &[String]) -> Vec<String> {
        let start = find(sql, &tokens("returning"), 0).expect("a returning list") + 1;
        let mut names = Vec::new();
        let mut item: Vec<&String> = Vec::new();
        let mut depth = 0;
        for token in sql[start..].iter().chain([&",".to_owned()]) {
            match token.as_str() {
                "(" => depth += 1,
                ")" => depth -= 1,
                "," if depth == 0 => {
                    let name = match item.iter().rposition(|t| *t == "as") {
                        Some(alias) => item[alias + 1].clone(),
                        None => item.last().map(|t| (*t).clone()).unwrap_or_default(),
                    };
                    names.push(name);
                    item.clear();
                    continue;
                }
                _ => {}
            }
            item.push(token);
        }
        names
    }

    /// The scope's policy row, as every function picks it (its exact row, else
    /// the longest family it extends): the floor's lookups are this one,
    /// for the scope each names.
    fn policy_lookup(scope: &str) -> Vec<String> {
        let (_, policy) = latest("function", "idempotency_policy");
        let lookup = span(&tokens(policy), "from agent.idempotency_scopes s", "limit 1");
        substitute(lookup, &[("p_scope", scope, "the scope the floor looks up")])
    }

    #[test]
    fn the_floor_claim_is_the_migrations_first_claim() {
        // idempotency_claim decides through idempotency_decide, whose first
        // claim (p_may_insert) is the statement the floor mirrors.
        let (file, claim) = latest("function", "idempotency_claim");
        let claim = tokens(claim);
        assert!(
            find(&claim, &tokens("returns setof agent.idempotency_claim_outcome"), 0).is_some()
                && find(&claim, &tokens("agent.idempotency_decide("), 0).is_some(),
            "{file}: idempotency_claim no longer answers idempotency_claim_outcome through idempotency_decide; \
             point the floor's check at what it does now"
        );
        let (file, decide) = latest("function", "idempotency_decide");
        let decide = tokens(decide);
        let floor = tokens(FLOOR_CLAIM);

        // The policy: the floor reads it in a CTE, the function in the insert.
        let policy = substitute(
            span(&decide, "from agent.idempotency_scopes s", "limit 1"),
            &[("p_scope", "'tool.bench'", "the floor's scope")],
        );
        assert_eq!(
            span(&floor, "from agent.idempotency_scopes s", "limit 1").join(" "),
            policy.join(" "),
            "{file}: the policy lookup"
        );
        assert_eq!(
            policy.join(" "),
            policy_lookup("'tool.bench'").join(" "),
            "{file}: the insert's lookup is idempotency_policy's"
        );

        // The insert: columns and values.
        let insert = substitute(
            span(&decide, "insert into agent.idempotency_keys", "greatest(s.retain, v_retain)"),
            &[
                (
                    "greatest(s.retain, v_retain)",
                    "p.retain",
                    "no caller retention: v_retain is the lease (60 s), below every policy's retention",
                ),
                ("p_organization_id", "$1", "bound"),
                ("p_scope", "'tool.bench'", "the floor's scope"),
                ("p_key", "$2", "bound"),
                ("p_request_hash", "$3", "bound"),
                ("p_lease_token", "$4", "bound"),
                ("v_at", "c.at", "the clock, read once in a CTE"),
                ("v_lease", "interval '60 seconds'", "the floor's lease"),
            ],
        );
        assert_eq!(
            span(&floor, "insert into agent.idempotency_keys", "p.retain").join(" "),
            insert.join(" "),
            "{file}: the insert"
        );
        assert_eq!(
            span(&floor, "on conflict", "do nothing").join(" "),
            span(&decide, "on conflict", "do nothing").join(" "),
            "{file}: the unique key"
        );

        // The answer: the outcome type's columns, in order, with those
        // later migrations added to it.
        let (file, outcome) = latest("type", "idempotency_claim_outcome");
        let mut fields = type_fields(outcome);
        fields.extend(added_attributes("idempotency_claim_outcome"));
        assert_eq!(returning_names(&floor), fields, "{file} and later: the claim's answer");
    }

    #[test]
    fn the_floor_completion_is_the_migrations_completion() {
        let (file, complete) = latest("function", "idempotency_complete");
        let complete = tokens(complete);
        let floor = tokens(FLOOR_COMPLETE);

        // The fenced update.
        let update = substitute(
            span(&complete, "update agent.idempotency_keys as k", "k.status = 'processing'"),
            &[
                (
                    "resource_type = v_resource_type, resource_id = v_resource_id,",
                    "",
                    "the floor completes with a response alone: both stay NULL, as the insert left them",
                ),
                ("v_response", "$4", "bound"),
                ("p_claim_id", "$1", "bound"),
                ("p_lease_token", "$2", "bound"),
                ("v_organization_id", "$3", "bound: the caller names the organization"),
            ],
        );
        assert_eq!(
            span(&floor, "update agent.idempotency_keys as k", "k.status = 'processing'").join(" "),
            update.join(" "),
            "{file}: the fenced update"
        );

        // The response limit: the function reads it from idempotency_policy,
        // the floor in the update's own condition.
        assert!(
            find(&complete, &tokens("select p.max_response_bytes into v_limit from agent.idempotency_policy("), 0)
                .is_some(),
            "{file}: idempotency_complete no longer takes its limit from idempotency_policy"
        );
        assert_eq!(
            span(&floor, "from agent.idempotency_scopes s", "limit 1").join(" "),
            policy_lookup("k.scope").join(" "),
            "{file}: the response limit's policy lookup"
        );

        // The answer: the claim type's columns, in order.
        let (file, claim) = latest("type", "idempotency_claim");
        assert_eq!(returning_names(&floor), type_fields(claim), "{file}: the completion's answer");
    }

    #[test]
    fn the_tokens_ignore_layout_case_comments_and_the_catalog_qualifier() {
        assert_eq!(
            tokens("SELECT  pg_catalog.left(s.scope, -1) -- why\n <= 'It''s', $12::text"),
            tokens("select left( s.scope , - 1 ) <= 'It''s' , $12 :: text")
        );
        assert_ne!(tokens("'A'"), tokens("'a'"), "a literal keeps its case");
        assert_eq!(tokens("a<=b"), ["a", "<=", "b"]);
    }
}
