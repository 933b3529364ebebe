//! Schema and CEL rules for size fields written as Kubernetes quantities (`10Gi`).
//!
//! `k8s_openapi`'s `Quantity` is published as `x-kubernetes-int-or-string`, which makes
//! CEL see a dynamic value; the size fields here are always strings so that the
//! `quantity()` CEL library can compare them (`isQuantity`, `compareTo`).

use schemars::{Schema, SchemaGenerator, json_schema};

/// JSON schema of a size field: a string holding a Kubernetes quantity.
pub fn quantity_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "maxLength": 64,
        "description": "A Kubernetes quantity, such as 10Gi or 500M.",
    })
}

/// The same as [`quantity_schema`] for an optional field.
pub fn optional_quantity_schema(generator: &mut SchemaGenerator) -> Schema {
    let mut schema = quantity_schema(generator);
    schema.insert("nullable".into(), true.into());
    schema
}
