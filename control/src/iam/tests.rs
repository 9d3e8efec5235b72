use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::testing::on_both_stores;

on_both_stores!(
    roles_inherit_down_the_project_tree_and_not_up_or_sideways,
    tokens_are_shown_once_stored_hashed_and_refused_once_revoked_or_expired,
    bad_input_gets_typed_errors_with_the_right_codes,
    service_accounts_belong_to_a_project_and_cluster_admin_is_separate,
    audit_records_are_kept_per_organization_in_time_order,
);

/// acme (alice admin) / rl (bob editor) / run-1 ; acme / web (carol viewer); other org "zeta".
async fn tree(store: Arc<dyn Store>) -> (Iam, IssuedToken, IssuedToken, IssuedToken) {
    let iam = Iam::new(store);
    let alice = iam.bootstrap("acme", "alice").await.unwrap();
    let acme: ProjectPath = "acme".parse().unwrap();
    let rl = iam.create_project(&acme, "rl").await.unwrap().path;
    iam.create_project(&rl, "run-1").await.unwrap();
    let web = iam.create_project(&acme, "web").await.unwrap().path;
    iam.create_org("zeta").await.unwrap();
    let mut tokens = Vec::new();
    for (name, project, role) in [("bob", &rl, Role::Editor), ("carol", &web, Role::Viewer)] {
        let id = PrincipalId::user(name).unwrap();
        iam.create_principal(id.clone(), name, false).await.unwrap();
        iam.grant(&id, project, role).await.unwrap();
        tokens.push(iam.issue_token(&id, "laptop", None).await.unwrap());
    }
    let carol = tokens.pop().unwrap();
    let bob = tokens.pop().unwrap();
    (iam, alice, bob, carol)
}

fn path(text: &str) -> ProjectPath {
    text.parse().unwrap()
}

async fn roles_inherit_down_the_project_tree_and_not_up_or_sideways(store: Arc<dyn Store>) {
    let (iam, alice, bob, carol) = tree(store).await;
    let allowed = |token: &IssuedToken, project: &str, action: Action| {
        let iam = iam.clone();
        let token = token.secret.clone();
        let project = path(project);
        async move { iam.authorize(&token, &project, action).await }
    };
    // The org admin can do everything everywhere in the org.
    for project in ["acme", "acme/rl", "acme/rl/run-1", "acme/web"] {
        let caller = allowed(&alice, project, Action::ProjectSetQuota)
            .await
            .unwrap();
        assert_eq!(caller.role, Some(Role::Admin));
        assert_eq!(caller.principal, PrincipalId::user("alice").unwrap());
    }
    // An editor of acme/rl creates there and below, reads nothing above or beside.
    allowed(&bob, "acme/rl", Action::SandboxCreate)
        .await
        .unwrap();
    allowed(&bob, "acme/rl/run-1", Action::SandboxExec)
        .await
        .unwrap();
    for (project, action) in [
        ("acme/rl", Action::ProjectCreate),
        ("acme", Action::SandboxList),
        ("acme/web", Action::SandboxGet),
        ("zeta", Action::SandboxGet),
    ] {
        let e = allowed(&bob, project, action).await.unwrap_err();
        assert_eq!(
            e.code(),
            tonic::Code::PermissionDenied,
            "{project} {action}: {e}"
        );
    }
    // A viewer reads but cannot create.
    allowed(&carol, "acme/web", Action::SandboxList)
        .await
        .unwrap();
    let e = allowed(&carol, "acme/web", Action::SandboxCreate)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("needs the editor role") && e.to_string().contains("it is viewer"),
        "{e}"
    );
    // Raising bob on the org reaches every project; revoking it takes that back.
    let bob_id = PrincipalId::user("bob").unwrap();
    iam.grant(&bob_id, &path("acme"), Role::Viewer)
        .await
        .unwrap();
    allowed(&bob, "acme/web", Action::SandboxGet).await.unwrap();
    assert!(iam.revoke_role(&bob_id, &path("acme")).await.unwrap());
    assert!(allowed(&bob, "acme/web", Action::SandboxGet).await.is_err());
    assert_eq!(iam.bindings_of(&bob_id).await.unwrap().len(), 1);
}

async fn tokens_are_shown_once_stored_hashed_and_refused_once_revoked_or_expired(
    store: Arc<dyn Store>,
) {
    let (iam, _alice, bob, _carol) = tree(store.clone()).await;
    let rl = path("acme/rl");
    // Nothing in the store holds the secret.
    let everything = store.range("/dsec/").await.unwrap();
    let secret_part = &bob.secret[bob.secret.len() - 64..];
    for kv in &everything.kvs {
        assert!(
            !String::from_utf8_lossy(&kv.value).contains(secret_part),
            "{}",
            kv.key
        );
    }
    assert!(format!("{bob:?}").contains("<hidden>"));

    // A token with the right id but another secret is unknown, not "wrong secret".
    let forged = format!("{}{}", &bob.secret[..bob.secret.len() - 64], "0".repeat(64));
    let e = iam
        .authorize(&forged, &rl, Action::SandboxGet)
        .await
        .unwrap_err();
    assert!(matches!(e, IamError::TokenUnknown), "{e}");

    let bob_id = PrincipalId::user("bob").unwrap();
    let second = iam.issue_token(&bob_id, "ci", None).await.unwrap();
    let ids: Vec<String> = iam
        .tokens_of(&bob_id)
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.id)
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&bob.id) && ids.contains(&second.id));

    iam.revoke_token(&bob.id).await.unwrap();
    let e = iam
        .authorize(&bob.secret, &rl, Action::SandboxGet)
        .await
        .unwrap_err();
    assert!(matches!(e, IamError::TokenRevoked(_)), "{e}");
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    iam.authorize(&second.secret, &rl, Action::SandboxGet)
        .await
        .unwrap();
    assert!(
        iam.revoke_token(&bob.id)
            .await
            .unwrap()
            .revoked_ms
            .is_some(),
        "idempotent"
    );

    let short = iam
        .issue_token(&bob_id, "short", Some(Duration::from_secs(1)))
        .await
        .unwrap();
    iam.authorize(&short.secret, &rl, Action::SandboxGet)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let e = iam
        .authorize(&short.secret, &rl, Action::SandboxGet)
        .await
        .unwrap_err();
    assert!(matches!(e, IamError::TokenExpired(_)), "{e}");
}

async fn bad_input_gets_typed_errors_with_the_right_codes(store: Arc<dyn Store>) {
    use tonic::Code;
    let (iam, alice, _bob, _carol) = tree(store).await;
    let cases: Vec<(IamError, Code)> = vec![
        (
            iam.authorize("Bearer abc", &path("acme"), Action::SandboxGet)
                .await
                .unwrap_err(),
            Code::Unauthenticated,
        ),
        (
            iam.authorize(&alice.secret, &path("acme/nope"), Action::SandboxGet)
                .await
                .unwrap_err(),
            Code::NotFound,
        ),
        (
            "acme/Bad_Name".parse::<ProjectPath>().unwrap_err(),
            Code::InvalidArgument,
        ),
        (
            "a/b/c/d/e/f/g".parse::<ProjectPath>().unwrap_err(),
            Code::InvalidArgument,
        ),
        (
            "acme//rl".parse::<ProjectPath>().unwrap_err(),
            Code::InvalidArgument,
        ),
        (
            "-acme".parse::<ProjectPath>().unwrap_err(),
            Code::InvalidArgument,
        ),
        (
            "root".parse::<PrincipalId>().unwrap_err(),
            Code::InvalidArgument,
        ),
        ("owner".parse::<Role>().unwrap_err(), Code::InvalidArgument),
        (
            iam.create_project(&path("acme"), "rl").await.unwrap_err(),
            Code::AlreadyExists,
        ),
        (
            iam.create_project(&path("ghost"), "x").await.unwrap_err(),
            Code::NotFound,
        ),
        (
            iam.create_org("acme/x").await.unwrap_err(),
            Code::InvalidArgument,
        ),
        (
            iam.grant(
                &PrincipalId::user("nobody").unwrap(),
                &path("acme"),
                Role::Admin,
            )
            .await
            .unwrap_err(),
            Code::NotFound,
        ),
        (
            iam.issue_token(
                &PrincipalId::user("alice").unwrap(),
                "",
                Some(Duration::from_millis(10)),
            )
            .await
            .unwrap_err(),
            Code::InvalidArgument,
        ),
        (
            iam.revoke_token("0123456789abcdef").await.unwrap_err(),
            Code::NotFound,
        ),
    ];
    for (error, code) in cases {
        assert_eq!(error.code(), code, "{error}");
        let status = tonic::Status::from(error);
        assert!(!status.message().is_empty());
    }
}

async fn service_accounts_belong_to_a_project_and_cluster_admin_is_separate(store: Arc<dyn Store>) {
    let (iam, alice, bob, _carol) = tree(store).await;
    let rl = path("acme/rl");
    let trainer = PrincipalId::service_account(&rl, "trainer").unwrap();
    assert_eq!(trainer.to_string(), "sa:acme/rl:trainer");
    assert_eq!(
        "sa:acme/rl:trainer".parse::<PrincipalId>().unwrap(),
        trainer
    );
    iam.create_principal(trainer.clone(), "RL job", false)
        .await
        .unwrap();
    iam.grant(&trainer, &path("acme/rl/run-1"), Role::Editor)
        .await
        .unwrap();
    let token = iam.issue_token(&trainer, "job 7", None).await.unwrap();
    iam.authorize(&token.secret, &path("acme/rl/run-1"), Action::SandboxCreate)
        .await
        .unwrap();
    assert!(iam
        .authorize(&token.secret, &rl, Action::SandboxCreate)
        .await
        .is_err());
    let ghost = PrincipalId::service_account(&path("acme/ghost"), "x").unwrap();
    assert_eq!(
        iam.create_principal(ghost, "", false)
            .await
            .unwrap_err()
            .code(),
        tonic::Code::NotFound
    );

    iam.authorize_cluster(&alice.secret).await.unwrap();
    let e = iam.authorize_cluster(&bob.secret).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied);
}

async fn audit_records_are_kept_per_organization_in_time_order(store: Arc<dyn Store>) {
    let (iam, alice, bob, _carol) = tree(store).await;
    let rl = path("acme/rl");
    let caller = iam
        .authorize(&alice.secret, &rl, Action::SandboxCreate)
        .await
        .unwrap();
    let denied = iam
        .authorize(&bob.secret, &path("acme/web"), Action::SandboxCreate)
        .await
        .unwrap_err();
    let records = [
        AuditRecord {
            at_ms: now_ms(),
            principal: caller.principal.clone(),
            token_id: Some(caller.token_id.clone()),
            project: rl.clone(),
            action: Action::SandboxCreate,
            target: Some("sb-n1-abcdefghijkl".into()),
            outcome: Outcome::Allowed,
        },
        AuditRecord {
            at_ms: now_ms() + 1,
            principal: PrincipalId::user("bob").unwrap(),
            token_id: Some(bob.id.clone()),
            project: path("acme/web"),
            action: Action::SandboxCreate,
            target: None,
            outcome: Outcome::Denied {
                reason: denied.to_string(),
            },
        },
        AuditRecord {
            at_ms: now_ms() + 2,
            principal: PrincipalId::user("alice").unwrap(),
            token_id: None,
            project: path("zeta"),
            action: Action::ProjectGet,
            target: None,
            outcome: Outcome::Allowed,
        },
    ];
    for record in &records {
        iam.audit(record).await.unwrap();
    }
    assert_eq!(iam.audit_log("acme", 10).await.unwrap(), records[..2]);
    assert_eq!(iam.audit_log("acme", 1).await.unwrap(), records[1..2]);
    assert_eq!(iam.audit_log("zeta", 10).await.unwrap(), records[2..]);
}
