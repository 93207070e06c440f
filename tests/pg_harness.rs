//! The PostgreSQL test harness (crates/testpg) itself: the cluster
//! answers, and each fresh database is a database of its own.

mod common;

use common::pg;

#[tokio::test]
async fn the_cluster_answers() {
    let c = pg::connect(&pg::admin_url().await).await;
    let one: i32 = c.query_one("select 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
}

#[tokio::test]
async fn fresh_databases_are_distinct_and_empty() {
    let (a, b) = (pg::fresh_database().await, pg::fresh_database().await);
    assert_ne!(a, b);
    let (ca, cb) = (pg::connect(&a).await, pg::connect(&b).await);
    let (da, db) = (current_database(&ca).await, current_database(&cb).await);
    assert_ne!(da, db);
    // the URL names its database (`.../NAME`, or `dbname=NAME` with a
    // key=value AGQ_TEST_DATABASE_URL)
    for (url, name) in [(&a, &da), (&b, &db)] {
        assert!(
            url.ends_with(&format!("/{name}")) || url.ends_with(&format!("dbname={name}")),
            "{url} is database {name}"
        );
    }

    // a table made in one is not in the other, which takes the same name
    ca.batch_execute("CREATE TABLE t (x int); INSERT INTO t VALUES (7)")
        .await
        .unwrap();
    let tables: i64 = cb
        .query_one(
            "select count(*) from pg_tables where schemaname = 'public'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0, "a fresh database has no tables");
    cb.batch_execute("CREATE TABLE t (x int)").await.unwrap();
    let rows: i64 = cb
        .query_one("select count(*) from t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
    let x: i32 = ca.query_one("select x from t", &[]).await.unwrap().get(0);
    assert_eq!(x, 7);
}

async fn current_database(c: &tokio_postgres::Client) -> String {
    c.query_one("select current_database()", &[])
        .await
        .unwrap()
        .get(0)
}

#[test]
fn with_dbname_replaces_the_database() {
    for (url, want) in [
        ("postgres://a@h:1/postgres", "postgres://a@h:1/x"),
        ("postgres://a@h:1", "postgres://a@h:1/x"),
        (
            "postgresql://a:p@h/db?sslmode=disable",
            "postgresql://a:p@h/x?sslmode=disable",
        ),
        ("postgres://h?user=a", "postgres://h/x?user=a"),
        ("host=h user=a dbname=postgres", "host=h user=a dbname=x"),
        ("host=h", "host=h dbname=x"),
    ] {
        assert_eq!(pg::with_dbname(url, "x"), want, "{url}");
    }
}
