//! Reading the Prometheus families back for `/admin/status`: every series of a family with
//! its labels, sums by label. The series are read, never created: a family stays
//! unexported until the request path uses it.

use super::recent::PrefixCounters;
use crate::shared::Shared;
use prometheus::core::Collector;
use std::collections::BTreeMap;

/// A family's series: (labels, value).
pub(super) type Rows = Vec<(BTreeMap<String, String>, f64)>;

/// Every (labels, value) of a counter (or gauge) family.
pub(super) fn rows(c: &dyn Collector) -> Rows {
    let mut out = Vec::new();
    for mf in c.collect() {
        for m in mf.get_metric() {
            let labels = m
                .get_label()
                .iter()
                .map(|l| (l.name().to_string(), l.value().to_string()))
                .collect();
            let v = if m.get_counter().is_some() {
                m.get_counter().value()
            } else {
                m.get_gauge().value()
            };
            out.push((labels, v));
        }
    }
    out
}

/// Sum of a family's values over the series whose `key` label is `value`, by the label `by`.
pub(super) fn sum_by(rows: &Rows, key: &str, value: &str, by: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (l, v) in rows {
        if l.get(key).is_some_and(|x| x == value) {
            *out.entry(l.get(by).cloned().unwrap_or_default())
                .or_insert(0.0) += v;
        }
    }
    out
}

/// Sum of a family's values by the label `by`, over all its series.
pub(super) fn sum_all_by(rows: &Rows, by: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (l, v) in rows {
        *out.entry(l.get(by).cloned().unwrap_or_default())
            .or_insert(0.0) += v;
    }
    out
}

/// The sum found under `k`, as a count (0 when absent).
pub(super) fn count(found: &BTreeMap<String, f64>, k: &str) -> u64 {
    found.get(k).copied().unwrap_or(0.0) as u64
}

/// A histogram family's (sample count, sample sum) by the label `by`, over the series
/// `keep` accepts (by their labels).
pub(super) fn histograms_by(
    c: &dyn Collector,
    by: &str,
    keep: impl Fn(&[prometheus::proto::LabelPair]) -> bool,
) -> BTreeMap<String, (u64, f64)> {
    let mut out: BTreeMap<String, (u64, f64)> = BTreeMap::new();
    for mf in c.collect() {
        for x in mf.get_metric() {
            if !keep(x.get_label()) {
                continue;
            }
            let label = x
                .get_label()
                .iter()
                .find(|l| l.name() == by)
                .map(|l| l.value().to_string())
                .unwrap_or_default();
            let e = out.entry(label).or_default();
            e.0 += x.get_histogram().sample_count();
            e.1 += x.get_histogram().sample_sum();
        }
    }
    out
}

/// Per service, the cumulative [`PrefixCounters`].
pub(super) fn prefix_counters(shared: &Shared) -> Vec<(String, PrefixCounters)> {
    let m = &shared.metrics;
    let rt = shared.runtime.load();
    rt.ordered
        .iter()
        .map(|s| {
            let svc = s.name.as_str();
            let p = |k| m.prefix_tokens.with_label_values(&[svc, k]).get();
            let e = |k| m.engine_tokens.with_label_values(&[svc, k]).get();
            (
                s.name.clone(),
                [
                    p("prompt"),
                    p("ceiling"),
                    p("predicted"),
                    e("prompt"),
                    e("cached"),
                    e("predicted"),
                ],
            )
        })
        .collect()
}

/// Sum of a token kind over every service.
pub(super) fn tokens_total(shared: &Shared, kind: &str) -> u64 {
    let rt = shared.runtime.load();
    rt.ordered
        .iter()
        .map(|s| {
            shared
                .metrics
                .tokens
                .with_label_values(&[s.name.as_str(), kind])
                .get()
        })
        .sum()
}
