//! The re-drive routes the operator named (`--route SCOPE=URL`): where the
//! console's "re-drive now" asks, exactly as `idem redrive --to URL
//! --scope SCOPE` does.

use idempotency_plane::PostgrestClient;

use crate::redrive;

/// A scope (`webhook.stripe`) or family (`webhook.*`) and its route.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    scope: String,
    url: url::Url,
}

/// Why a `--route` was refused before the console started.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RouteArgError {
    /// Not `SCOPE=URL`.
    #[error("--route {0:?}: expected SCOPE=URL (e.g. webhook.stripe=https://<ref>.supabase.co/functions/v1/webhooks/redrive)")]
    Shape(String),
    /// A URL `idem redrive --to` would refuse too.
    #[error("--route {scope}={source}")]
    Url { scope: String, source: redrive::RouteError },
    /// A scope named twice.
    #[error("--route {0}: named twice")]
    Twice(String),
}

/// The configured routes.
#[derive(Debug, Clone, Default)]
pub(crate) struct Routes(Vec<Route>);

impl Routes {
    /// Parses each `SCOPE=URL`, every URL checked as `idem redrive --to`
    /// checks it (the service key goes to it).
    pub(crate) fn parse(client: &PostgrestClient, args: &[String]) -> Result<Self, RouteArgError> {
        let mut routes: Vec<Route> = Vec::with_capacity(args.len());
        for arg in args {
            let Some((scope, to)) = arg.split_once('=').filter(|(scope, to)| !scope.is_empty() && !to.is_empty())
            else {
                return Err(RouteArgError::Shape(arg.clone()));
            };
            if routes.iter().any(|route| route.scope == scope) {
                return Err(RouteArgError::Twice(scope.to_owned()));
            }
            let url =
                redrive::route(client, to).map_err(|source| RouteArgError::Url { scope: scope.to_owned(), source })?;
            routes.push(Route { scope: scope.to_owned(), url });
        }
        Ok(Routes(routes))
    }

    /// The route that re-drives `scope`, with the scope or family it was
    /// named for (what the console asks it for, as `idem redrive --scope`
    /// would): the one named for `scope` itself, else the one of the
    /// longest family (`webhook.*`) it belongs to.
    pub(crate) fn for_scope(&self, scope: &str) -> Option<(&str, &url::Url)> {
        let exact = self.0.iter().find(|route| route.scope == scope);
        let route = exact.or_else(|| {
            self.0
                .iter()
                .filter_map(|route| route.scope.strip_suffix('*').map(|prefix| (prefix, route)))
                .filter(|(prefix, _)| prefix.ends_with('.') && scope.starts_with(prefix))
                .max_by_key(|(prefix, _)| prefix.len())
                .map(|(_, route)| route)
        })?;
        Some((route.scope.as_str(), &route.url))
    }

    /// The scopes and families with a route, as named.
    pub(crate) fn scopes(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|route| route.scope.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> PostgrestClient {
        let config = idempotency_plane::ClientConfig::new("https://ref.supabase.co/rest/v1", "sb_secret_test").unwrap();
        PostgrestClient::new(config).unwrap()
    }

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|arg| (*arg).to_owned()).collect()
    }

    #[test]
    fn a_scope_takes_its_own_route_else_its_longest_familys() {
        let routes = Routes::parse(
            &client(),
            &args(&[
                "webhook.*=https://ref.supabase.co/functions/v1/webhooks/redrive",
                "webhook.stripe.*=https://ref.supabase.co/functions/v1/stripe/redrive",
                "queue.orders=http://127.0.0.1:9000/redrive",
            ]),
        )
        .unwrap();
        let route = |scope: &str| routes.for_scope(scope).map(|(named, url)| format!("{named} {}", url.path()));
        assert_eq!(route("webhook.slack").as_deref(), Some("webhook.* /functions/v1/webhooks/redrive"));
        assert_eq!(route("webhook.stripe.eu").as_deref(), Some("webhook.stripe.* /functions/v1/stripe/redrive"));
        assert_eq!(route("queue.orders").as_deref(), Some("queue.orders /redrive"));
        assert_eq!(route("queue.other"), None);
        assert_eq!(route("webhookx.slack"), None);
        assert_eq!(routes.scopes().count(), 3);
    }

    #[test]
    fn a_route_the_service_key_may_not_go_to_is_refused_as_redrive_refuses_it() {
        for bad in ["webhook.stripe", "=https://ref.supabase.co/x", "webhook.stripe="] {
            assert!(matches!(Routes::parse(&client(), &args(&[bad])), Err(RouteArgError::Shape(_))), "{bad}");
        }
        let plain = Routes::parse(&client(), &args(&["webhook.stripe=http://example.com/redrive"]));
        assert!(matches!(plain, Err(RouteArgError::Url { .. })), "{plain:?}");
        let twice =
            Routes::parse(&client(), &args(&["a.b=https://ref.supabase.co/x", "a.b=https://ref.supabase.co/y"]));
        assert!(matches!(twice, Err(RouteArgError::Twice(_))));
    }
}
