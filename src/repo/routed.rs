//! A tenant router: several planes, each organization on exactly one.
//!
//! When one plane (one database behind one PostgREST) is not enough, an
//! operator runs several and assigns each organization to one of them.
//! Every claim's unique key starts with its organization, and every call on
//! a claim or a Run names it, so routing by organization is exact: all of an
//! organization's claims live on one plane, and each call goes to exactly
//! one plane. Nothing is decided across planes: each keeps its own atomic
//! SQL, its own clock and its own journal.
//!
//! An organization must not move to another plane while it has claims in
//! retention: its next call would miss its journal there, and a replay would
//! run its effect again. To move one, stop its traffic and wait out its
//! longest retention (30 days for tool scopes), or copy its rows to the new
//! plane before routing it there.

use std::collections::HashMap;

use uuid::Uuid;

use super::{
    AdmittedRun, ClaimCall, ClaimFence, ClaimRequest, ClaimRow, CompletionArgs, IdempotencyRecord,
    IdempotencyRepository, ProviderJob, ProviderJobRepository, RunRepository,
};
use crate::error::Error;

/// Routes every call to the plane its organization is assigned to.
///
/// Implements [`IdempotencyRepository`], [`RunRepository`] and
/// [`ProviderJobRepository`] over any repository `R` that does, so an
/// [`IdempotencyService`](crate::IdempotencyService) or a caller runs over
/// it unchanged. An organization with no assignment goes to the default
/// plane, if there is one; otherwise every call for it is
/// [`Error::UnroutedOrganization`], and nothing is sent to any plane.
///
/// Not [`ExpiredClaims`](super::ExpiredClaims): retention is each plane's,
/// and the sweeper runs a bounded pass per plane over [`planes`](Self::planes).
///
/// The assignments are fixed when the router is built, because an
/// organization must not move between planes while it has claims in
/// retention: its next call would miss its journal on the new plane, and a
/// replay would run its effect again. To move one, stop its traffic and wait
/// out its longest retention, or copy its rows to the new plane first.
#[derive(Debug)]
pub struct TenantRouter<R> {
    planes: Vec<Plane<R>>,
    assignments: HashMap<Uuid, usize>,
    default: Option<usize>,
}

/// One plane of a router: its name (for logs and the operator) and its
/// repository.
#[derive(Debug)]
struct Plane<R> {
    name: String,
    repo: R,
}

/// A router's configuration, checked by [`build`](Self::build).
#[derive(Debug)]
pub struct TenantRouterBuilder<R> {
    planes: Vec<Plane<R>>,
    assignments: Vec<(Uuid, String)>,
    default: Option<String>,
}

/// A router configuration that cannot route exactly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouterConfigError {
    /// No plane was added: no organization could be routed.
    #[error("the tenant router has no plane")]
    NoPlanes,
    /// Two planes share a name, so an assignment to it would be ambiguous.
    #[error("two planes are named {name:?}")]
    DuplicatePlane {
        /// The name.
        name: String,
    },
    /// An assignment, or the default, names a plane that was not added.
    #[error("no plane is named {name:?}")]
    UnknownPlane {
        /// The name.
        name: String,
    },
    /// An organization is assigned to two planes: its claims would be split
    /// between them, and a replay could miss its journal.
    #[error("organization {organization_id} is assigned to both plane {first:?} and plane {second:?}")]
    AssignedTwice {
        /// The organization.
        organization_id: Uuid,
        /// The plane it was assigned to first.
        first: String,
        /// The other plane.
        second: String,
    },
}

impl<R> TenantRouter<R> {
    /// A router with no plane yet: add planes, assignments and a default,
    /// then [`build`](TenantRouterBuilder::build).
    pub fn builder() -> TenantRouterBuilder<R> {
        TenantRouterBuilder { planes: Vec::new(), assignments: Vec::new(), default: None }
    }

    /// The plane `organization_id` is routed to, with its name: its
    /// assignment, else the default plane. [`Error::UnroutedOrganization`]
    /// when it has neither.
    pub fn plane_for(&self, organization_id: Uuid) -> Result<(&str, &R), Error> {
        let index = self.assignments.get(&organization_id).copied().or(self.default);
        match index.and_then(|index| self.planes.get(index)) {
            Some(plane) => Ok((plane.name.as_str(), &plane.repo)),
            None => Err(Error::UnroutedOrganization { organization_id }),
        }
    }

    /// Every plane with its name, in the order they were added: what an
    /// operator sweeps, one bounded pass per plane.
    pub fn planes(&self) -> impl ExactSizeIterator<Item = (&str, &R)> + '_ {
        self.planes.iter().map(|plane| (plane.name.as_str(), &plane.repo))
    }

    /// The plane named `name`, if there is one.
    pub fn plane(&self, name: &str) -> Option<&R> {
        self.planes.iter().find(|plane| plane.name == name).map(|plane| &plane.repo)
    }

    fn route(&self, organization_id: Uuid) -> Result<&R, Error> {
        self.plane_for(organization_id).map(|(_, repo)| repo)
    }
}

impl<R> TenantRouterBuilder<R> {
    /// Adds a plane named `name`. Names must be unique.
    pub fn plane(mut self, name: impl Into<String>, repo: R) -> Self {
        self.planes.push(Plane { name: name.into(), repo });
        self
    }

    /// Assigns `organization_id` to the plane named `plane`. Assigning it
    /// again to the same plane changes nothing; to another is refused.
    pub fn assign(mut self, organization_id: Uuid, plane: impl Into<String>) -> Self {
        self.assignments.push((organization_id, plane.into()));
        self
    }

    /// Routes every organization with no assignment to the plane named
    /// `plane`. Without a default, such an organization is refused.
    pub fn default_plane(mut self, plane: impl Into<String>) -> Self {
        self.default = Some(plane.into());
        self
    }

    /// The router, or why its configuration cannot route exactly: no plane,
    /// two planes with one name, a name no plane has, or an organization
    /// assigned to two planes.
    pub fn build(self) -> Result<TenantRouter<R>, RouterConfigError> {
        if self.planes.is_empty() {
            return Err(RouterConfigError::NoPlanes);
        }
        let mut index_of = HashMap::with_capacity(self.planes.len());
        for (index, plane) in self.planes.iter().enumerate() {
            if index_of.insert(plane.name.as_str(), index).is_some() {
                return Err(RouterConfigError::DuplicatePlane { name: plane.name.clone() });
            }
        }
        let find = |name: &str| {
            index_of.get(name).copied().ok_or_else(|| RouterConfigError::UnknownPlane { name: name.to_owned() })
        };
        let mut assignments = HashMap::with_capacity(self.assignments.len());
        for (organization_id, name) in &self.assignments {
            let index = find(name)?;
            match assignments.insert(*organization_id, index) {
                Some(first) if first != index => {
                    return Err(RouterConfigError::AssignedTwice {
                        organization_id: *organization_id,
                        first: self.planes[first].name.clone(),
                        second: name.clone(),
                    });
                }
                _ => {}
            }
        }
        let default = self.default.as_deref().map(find).transpose()?;
        Ok(TenantRouter { planes: self.planes, assignments, default })
    }
}

/// Each call goes to the plane of its organization, and only there.
impl<R: IdempotencyRepository> IdempotencyRepository for TenantRouter<R> {
    async fn claim(&self, call: &ClaimCall<'_>) -> Result<ClaimRow, Error> {
        self.route(call.organization_id)?.claim(call).await
    }

    async fn try_claim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        self.route(request.organization_id)?.try_claim(request).await
    }

    async fn reclaim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        self.route(request.organization_id)?.reclaim(request).await
    }

    async fn get(&self, organization_id: Uuid, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, Error> {
        self.route(organization_id)?.get(organization_id, scope, key).await
    }

    async fn complete(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        completion: CompletionArgs<'_>,
    ) -> Result<Option<IdempotencyRecord>, Error> {
        self.route(organization_id)?.complete(organization_id, claim_id, lease_token, completion).await
    }

    async fn release(&self, organization_id: Uuid, claim_id: Uuid, lease_token: Uuid) -> Result<bool, Error> {
        self.route(organization_id)?.release(organization_id, claim_id, lease_token).await
    }

    async fn extend(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        lease: std::time::Duration,
    ) -> Result<Option<chrono::DateTime<chrono::Utc>>, Error> {
        self.route(organization_id)?.extend(organization_id, claim_id, lease_token, lease).await
    }
}

/// Each call goes to the plane of its organization, and only there: a
/// fenced admission's claim is that organization's, so on the same plane.
impl<R: RunRepository> RunRepository for TenantRouter<R> {
    async fn admit(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        admission_token: Uuid,
        max_run_duration: Option<std::time::Duration>,
    ) -> Result<AdmittedRun, Error> {
        self.route(organization_id)?.admit(organization_id, start_key, input, admission_token, max_run_duration).await
    }

    async fn admit_fenced(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        admission_token: Uuid,
        fence: ClaimFence,
    ) -> Result<Option<AdmittedRun>, Error> {
        let plane = self.route(organization_id)?;
        plane.admit_fenced(organization_id, start_key, input, admission_token, fence).await
    }

    async fn find(
        &self,
        organization_id: Uuid,
        start_key: &str,
        admission_token: Option<Uuid>,
    ) -> Result<Option<AdmittedRun>, Error> {
        self.route(organization_id)?.find(organization_id, start_key, admission_token).await
    }
}

/// `register` goes to the plane of its organization. A callback names no
/// organization, so `lookup` asks the planes one after another, in the order
/// they were added: the first that holds the job answers it. A plane that
/// fails does not end the search (an organization on a healthy plane still
/// gets its callbacks), but when no plane holds the job and one could not be
/// asked, the answer is that plane's error, never `None`: a webhook gate
/// drops a delivery for a job it is told is unknown, and the job may be on
/// the plane that failed. A lookup costs up to one round trip per plane.
///
/// A plane refuses the same job id under a second organization only among
/// its own organizations; the router does not check the other planes.
impl<R: ProviderJobRepository> ProviderJobRepository for TenantRouter<R> {
    async fn register(&self, organization_id: Uuid, provider: &str, job_id: &str) -> Result<ProviderJob, Error> {
        self.route(organization_id)?.register(organization_id, provider, job_id).await
    }

    async fn lookup(&self, provider: &str, job_id: &str) -> Result<Option<ProviderJob>, Error> {
        let mut failed = None;
        for plane in &self.planes {
            match plane.repo.lookup(provider, job_id).await {
                Ok(Some(job)) => return Ok(Some(job)),
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(plane = %plane.name, %error, provider, job_id, "a plane could not look up the job");
                    failed.get_or_insert(error);
                }
            }
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::postgrest::ClientError;
    use crate::repo::{ClaimDecision, ClaimStatus, MemoryRepository};
    use crate::{ClaimOutcome, Completion, Ending, IdempotencyService, RequestHash};

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    const HASH: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const SCOPE: &str = "tool.email.send";

    fn call(organization_id: Uuid, key: &str) -> ClaimCall<'_> {
        ClaimCall {
            organization_id,
            scope: SCOPE,
            key,
            request_hash: HASH,
            lease_token: Uuid::new_v4(),
            lease: Duration::from_secs(30),
            request: None,
        }
    }

    /// Planes `one` and `two`; `a` on one, `b` on two; no default.
    fn two_planes(a: Uuid, b: Uuid) -> Result<TenantRouter<MemoryRepository>, RouterConfigError> {
        TenantRouter::builder()
            .plane("one", MemoryRepository::new())
            .plane("two", MemoryRepository::new())
            .assign(a, "one")
            .assign(b, "two")
            .build()
    }

    fn plane<'r>(router: &'r TenantRouter<MemoryRepository>, name: &str) -> Result<&'r MemoryRepository, String> {
        router.plane(name).ok_or_else(|| format!("no plane {name}"))
    }

    #[tokio::test]
    async fn each_organizations_claims_land_on_its_plane_only() -> TestResult {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let router = two_planes(a, b)?;
        let (one, two) = (plane(&router, "one")?, plane(&router, "two")?);
        assert_eq!(router.claim(&call(a, "k-a")).await?.outcome, ClaimDecision::Claimed);
        assert_eq!(router.claim(&call(b, "k-b")).await?.outcome, ClaimDecision::Claimed);
        assert!(one.get(a, SCOPE, "k-a").await?.is_some());
        assert!(two.get(a, SCOPE, "k-a").await?.is_none());
        assert!(two.get(b, SCOPE, "k-b").await?.is_some());
        assert!(one.get(b, SCOPE, "k-b").await?.is_none());
        assert_eq!((one.len(), two.len()), (1, 1));
        assert_eq!(router.plane_for(a)?.0, "one");
        assert_eq!(router.plane_for(b)?.0, "two");
        Ok(())
    }

    #[tokio::test]
    async fn complete_and_release_reach_the_plane_that_holds_the_claim() -> TestResult {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let router = two_planes(a, b)?;
        let (one, two) = (plane(&router, "one")?, plane(&router, "two")?);
        let done = call(b, "done");
        let row = router.claim(&done).await?;
        let response = serde_json::json!({"ok": true});
        let completion = CompletionArgs { response: Some(&response), ..CompletionArgs::default() };
        let completed = router.complete(b, row.id, done.lease_token, completion).await?;
        assert_eq!(completed.map(|record| record.status), Some(ClaimStatus::Completed));
        let stored = two.get(b, SCOPE, "done").await?;
        assert_eq!(stored.as_ref().map(|record| record.status), Some(ClaimStatus::Completed));
        assert_eq!(stored.and_then(|record| record.response), Some(response));

        let given_back = call(b, "given-back");
        let row = router.claim(&given_back).await?;
        assert!(router.release(b, row.id, given_back.lease_token).await?);
        assert!(two.get(b, SCOPE, "given-back").await?.is_none());
        assert!(one.is_empty());
        Ok(())
    }

    #[tokio::test]
    async fn an_organization_with_no_assignment_goes_to_the_default_plane() -> TestResult {
        let (a, other) = (Uuid::new_v4(), Uuid::new_v4());
        let router = TenantRouter::builder()
            .plane("one", MemoryRepository::new())
            .plane("two", MemoryRepository::new())
            .plane("three", MemoryRepository::new())
            .assign(a, "one")
            .default_plane("three")
            .build()?;
        router.claim(&call(other, "k")).await?;
        router.claim(&call(a, "k")).await?;
        assert!(plane(&router, "three")?.get(other, SCOPE, "k").await?.is_some());
        assert!(plane(&router, "one")?.get(a, SCOPE, "k").await?.is_some());
        assert!(plane(&router, "two")?.is_empty());
        assert_eq!(plane(&router, "three")?.len(), 1);
        assert_eq!(router.plane_for(other)?.0, "three");
        Ok(())
    }

    #[tokio::test]
    async fn an_unrouted_organization_is_refused_by_every_call_and_touches_no_plane() -> TestResult {
        let (a, b, stranger) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let router = two_planes(a, b)?;
        let unrouted = |result: Result<(), Error>| {
            assert!(
                matches!(result, Err(Error::UnroutedOrganization { organization_id }) if organization_id == stranger),
                "{result:?}"
            );
        };
        let request = ClaimRequest {
            organization_id: stranger,
            scope: SCOPE,
            key: "k",
            request_hash: HASH,
            lease_token: Uuid::new_v4(),
            lease: Duration::from_secs(30),
            retain: Duration::from_secs(60),
        };
        let (id, token, input) = (Uuid::new_v4(), Uuid::new_v4(), serde_json::json!({"q": 1}));
        let fence = ClaimFence { claim_id: id, lease_token: token };
        unrouted(router.claim(&call(stranger, "k")).await.map(drop));
        unrouted(router.try_claim(&request).await.map(drop));
        unrouted(router.reclaim(&request).await.map(drop));
        unrouted(router.get(stranger, SCOPE, "k").await.map(drop));
        unrouted(router.complete(stranger, id, token, CompletionArgs::default()).await.map(drop));
        unrouted(router.release(stranger, id, token).await.map(drop));
        unrouted(router.admit(stranger, "start", &input, token, None).await.map(drop));
        unrouted(router.admit_fenced(stranger, "start", &input, token, fence).await.map(drop));
        unrouted(router.find(stranger, "start", None).await.map(drop));
        unrouted(router.register(stranger, "nylas", "job-1").await.map(drop));
        unrouted(router.plane_for(stranger).map(drop));
        let error = Error::UnroutedOrganization { organization_id: stranger };
        assert!(!error.is_transient() && !error.never_reached_the_plane() && !error.is_unstorable_answer());
        assert!(!crate::service::may_have_written(&error));
        for (name, repo) in router.planes() {
            assert!(repo.is_empty(), "plane {name} holds a claim");
            assert!(repo.find(stranger, "start", None).await?.is_none(), "plane {name} admitted a Run");
            assert!(repo.lookup("nylas", "job-1").await?.is_none(), "plane {name} registered a job");
        }
        Ok(())
    }

    #[test]
    fn a_configuration_that_cannot_route_exactly_is_refused() {
        let org = Uuid::new_v4();
        let built = |builder: TenantRouterBuilder<MemoryRepository>| builder.build().err();
        assert_eq!(built(TenantRouter::builder()), Some(RouterConfigError::NoPlanes));
        assert_eq!(
            built(TenantRouter::builder().plane("one", MemoryRepository::new()).plane("one", MemoryRepository::new())),
            Some(RouterConfigError::DuplicatePlane { name: "one".into() })
        );
        assert_eq!(
            built(TenantRouter::builder().plane("one", MemoryRepository::new()).assign(org, "two")),
            Some(RouterConfigError::UnknownPlane { name: "two".into() })
        );
        assert_eq!(
            built(TenantRouter::builder().plane("one", MemoryRepository::new()).default_plane("two")),
            Some(RouterConfigError::UnknownPlane { name: "two".into() })
        );
        let twice = TenantRouter::builder()
            .plane("one", MemoryRepository::new())
            .plane("two", MemoryRepository::new())
            .assign(org, "one")
            .assign(org, "two");
        assert_eq!(
            built(twice),
            Some(RouterConfigError::AssignedTwice { organization_id: org, first: "one".into(), second: "two".into() })
        );
        let same_twice = TenantRouter::builder().plane("one", MemoryRepository::new()).assign(org, "one");
        assert!(same_twice.assign(org, "one").build().is_ok());
    }

    #[tokio::test]
    async fn a_job_registered_on_the_second_plane_is_found_by_a_lookup() -> TestResult {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let router = two_planes(a, b)?;
        let registered = router.register(b, "nylas", "job-1").await?;
        assert!(plane(&router, "one")?.lookup("nylas", "job-1").await?.is_none());
        let found = router.lookup("nylas", "job-1").await?;
        assert_eq!(found.as_ref().map(|job| (job.id, job.organization_id)), Some((registered.id, b)));
        assert!(router.lookup("nylas", "job-2").await?.is_none());
        Ok(())
    }

    /// A plane of provider jobs: one job, or a failure on every call.
    #[derive(Debug)]
    struct Jobs {
        held: Option<ProviderJob>,
        fails: bool,
        asked: AtomicUsize,
    }

    impl Jobs {
        fn holding(job: Option<ProviderJob>) -> Self {
            Jobs { held: job, fails: false, asked: AtomicUsize::new(0) }
        }

        fn failing() -> Self {
            Jobs { held: None, fails: true, asked: AtomicUsize::new(0) }
        }

        fn answer(&self) -> Result<Option<ProviderJob>, Error> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            if self.fails {
                return Err(Error::Store(ClientError::answered("provider_job_lookup", 503, "PGRST001")));
            }
            Ok(self.held.clone())
        }
    }

    impl ProviderJobRepository for Jobs {
        async fn register(&self, _: Uuid, _: &str, _: &str) -> Result<ProviderJob, Error> {
            Err(Error::Inconsistent("not under test".into()))
        }

        async fn lookup(&self, _: &str, _: &str) -> Result<Option<ProviderJob>, Error> {
            self.answer()
        }
    }

    fn job(organization_id: Uuid) -> ProviderJob {
        ProviderJob { id: Uuid::new_v4(), organization_id, provider: "nylas".into(), job_id: "job-1".into() }
    }

    #[tokio::test]
    async fn a_lookup_never_answers_unknown_while_a_plane_could_not_be_asked() -> TestResult {
        let router = TenantRouter::builder().plane("up", Jobs::holding(None)).plane("down", Jobs::failing()).build()?;
        let answer = router.lookup("nylas", "job-1").await;
        assert!(matches!(&answer, Err(error) if error.is_transient()), "{answer:?}");

        // The failure of one plane does not hide a job another one holds,
        // and the search ends at the plane that holds it.
        let org = Uuid::new_v4();
        let router = TenantRouter::builder()
            .plane("down", Jobs::failing())
            .plane("holds", Jobs::holding(Some(job(org))))
            .plane("after", Jobs::holding(None))
            .build()?;
        let found = router.lookup("nylas", "job-1").await?;
        assert_eq!(found.map(|job| job.organization_id), Some(org));
        let asked: Vec<usize> = router.planes().map(|(_, jobs)| jobs.asked.load(Ordering::Relaxed)).collect();
        assert_eq!(asked, [1, 1, 0]);
        Ok(())
    }

    #[tokio::test]
    async fn a_service_over_a_router_claims_completes_and_replays() -> TestResult {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let service = IdempotencyService::new(two_planes(a, b)?);
        let hash = RequestHash::of_json(&serde_json::json!({"to": "a@example.com"}));
        let lease = Duration::from_secs(30);
        let ClaimOutcome::Claimed(claim) = service.claim(a, SCOPE, "run-1:step-3", &hash, lease).await? else {
            return Err("the first claim did not claim".into());
        };
        let ending = service.complete(&claim, Completion::resource("email.message", "m-1")).await?;
        assert_eq!(ending, Ending::Recorded);
        let replay = service.claim(a, SCOPE, "run-1:step-3", &hash, lease).await?;
        assert!(
            matches!(&replay, ClaimOutcome::Completed { resource: Some(r), .. } if r.resource_id == "m-1"),
            "{replay:?}"
        );
        let router = service.repository();
        assert_eq!(plane(router, "one")?.len(), 1);
        assert!(plane(router, "two")?.is_empty());
        let unrouted = service.claim(Uuid::new_v4(), SCOPE, "k", &hash, lease).await;
        assert!(matches!(unrouted, Err(Error::UnroutedOrganization { .. })), "{unrouted:?}");
        Ok(())
    }
}
