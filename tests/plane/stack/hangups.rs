//! Clients that hang up mid-request (a worker stopped mid-call) leave the
//! local server's connections clean: every request runs to its end in a
//! task of its own, so none is cancelled while its transaction begins, which
//! with sqlx 0.9.0 would hand the connection back to the pool inside an open
//! transaction and run the next request in it, with a stale `now()`.

use std::time::Duration;

use idempotency_plane::local::LocalStackConfig;

use crate::support::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_that_hang_up_leave_no_open_transaction_for_the_next_request() {
    // One connection, so a leaked transaction meets the next request.
    let mut stack = stack_with(LocalStackConfig { pool_size: 1, ..LocalStackConfig::default() }).await;
    sqlx::raw_sql(
        "create function public.idem_test_lag() returns double precision language sql volatile
           as $$ select extract(epoch from pg_catalog.clock_timestamp() - pg_catalog.now()) * 1000 $$;
         grant execute on function public.idem_test_lag() to service_role;",
    )
    .execute(stack.db())
    .await
    .expect("the probe");
    stack.restart_server().await.expect("the server reads the probe");
    let url = format!("{}/rpc/idem_test_lag", stack.url());
    let key = stack.service_key().to_owned();
    let lag = || async {
        let answer = reqwest::Client::new().post(&url).bearer_auth(&key).json(&serde_json::json!({})).send().await;
        answer.expect("an answer").json::<f64>().await.expect("a lag")
    };

    let mut worst = 0.0_f64;
    for round in 0..10u64 {
        // Thirty requests cut after 0 to 2 ms, as a killed worker cuts them.
        let mut cut = Vec::new();
        for n in 0..30u64 {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_micros((round * 30 + n) * 67 % 2_000))
                .build()
                .expect("a client");
            let (url, key) = (url.clone(), key.clone());
            cut.push(tokio::spawn(async move {
                let _ = client.post(&url).bearer_auth(&key).json(&serde_json::json!({})).send().await;
            }));
        }
        for request in cut {
            let _ = request.await;
        }
        // Long enough for a leaked transaction's now() to fall far behind.
        tokio::time::sleep(Duration::from_millis(300)).await;
        for _ in 0..3 {
            worst = worst.max(lag().await);
        }
    }
    assert!(worst < 150.0, "a request ran inside a transaction begun {worst:.0} ms before it");
    stack.stop().await.unwrap();
}
