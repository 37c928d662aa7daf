//! Exact preferred allocation over a pair-weight matrix, for GPU-like devices whose links
//! differ (AMD XGMI vs PCIe, NVIDIA NVLink vs PCIe levels, partitions of one GPU).
//!
//! A set of devices scores the sum of its pair weights (higher = better link), and as a
//! tie-break the number of its pairs that share a NUMA node; the best set of the requested size
//! is found exactly, from the available devices only, always holding the must-include ones,
//! never padded with devices that were not offered.
//!
//! How it stays fast: devices that are interchangeable (the same weight to every other device
//! and the same NUMA node, e.g. the 8 CPX partitions of one MI300X) are grouped into classes
//! once, when the matrix is built. The search then decides how many devices to take from each
//! class, not which ones, by depth-first branch and bound: a bound from each device's gain plus
//! half of its best possible links to the rest cuts most branches, and a greedy answer found
//! first gives an early incumbent. A work budget caps pathological inputs (many classes, all
//! different); the best answer found within the budget is still valid and [`Selection::exact`] says
//! whether optimality was proven. Among equally good sets the first found is kept, which
//! favours earlier devices. [`brute_force`] is the reference the tests and the bench compare
//! with.

/// Work (about one unit per class pair looked at by the bound) before the search stops trying
/// to prove optimality: under 10 ms on the project's 2-core machine in release builds (8.5 ms
/// max on 64 all-different devices; 20M units took 95 ms). Structured inputs (a few classes,
/// like GPUs of partitions) never get near it.
const WORK_BUDGET: u64 = 1_000_000;

/// Symmetric pair weights between `n` devices, plus each device's NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairMatrix {
    n: usize,
    weights: Vec<u32>,
    numa: Vec<Option<i64>>,
    /// Class of each device: devices of one class are interchangeable.
    class_of: Vec<usize>,
    /// Members of each class, ascending.
    classes: Vec<Vec<usize>>,
}

/// How good a set is: link weight first, then how many pairs share a NUMA node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Score {
    /// Sum of the pair weights.
    pub links: u64,
    /// Pairs on the same (known) NUMA node.
    pub same_numa: u64,
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Device indices: the must-include ones first (in the given order), then the rest
    /// ascending. Shorter than asked only when too few devices were offered.
    pub devices: Vec<usize>,
    /// The set's score.
    pub score: Score,
    /// True when the search proved that no set scores higher.
    pub exact: bool,
}

impl PairMatrix {
    /// A matrix over `numa.len()` devices with `weight(a, b)` for each pair `a < b`.
    pub fn from_fn(numa: Vec<Option<i64>>, weight: impl Fn(usize, usize) -> u32) -> Self {
        let n = numa.len();
        let mut weights = vec![0u32; n.saturating_mul(n)];
        for a in 0..n {
            for b in (a + 1)..n {
                let w = weight(a, b);
                weights[a * n + b] = w;
                weights[b * n + a] = w;
            }
        }
        let mut matrix = PairMatrix {
            n,
            weights,
            numa,
            class_of: Vec::new(),
            classes: Vec::new(),
        };
        matrix.classify();
        matrix
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.n
    }

    /// True when there are no devices.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The weight between two distinct devices.
    pub fn weight(&self, a: usize, b: usize) -> u32 {
        self.weights[a * self.n + b]
    }

    /// Number of classes of interchangeable devices.
    pub fn class_count(&self) -> usize {
        self.classes.len()
    }

    fn same_numa(&self, a: usize, b: usize) -> bool {
        matches!((self.numa[a], self.numa[b]), (Some(x), Some(y)) if x == y)
    }

    /// Twins: the same weight to every third device and the same NUMA node. The relation is
    /// transitive, so comparing with each class's first member is enough.
    fn twins(&self, a: usize, b: usize) -> bool {
        self.numa[a] == self.numa[b]
            && (0..self.n)
                .filter(|&x| x != a && x != b)
                .all(|x| self.weight(a, x) == self.weight(b, x))
    }

    fn classify(&mut self) {
        let mut classes: Vec<Vec<usize>> = Vec::new();
        let mut class_of = Vec::with_capacity(self.n);
        for d in 0..self.n {
            match classes.iter().position(|c| self.twins(c[0], d)) {
                Some(k) => {
                    classes[k].push(d);
                    class_of.push(k);
                }
                None => {
                    class_of.push(classes.len());
                    classes.push(vec![d]);
                }
            }
        }
        self.classes = classes;
        self.class_of = class_of;
    }

    /// The score of a set of distinct devices.
    pub fn score(&self, set: &[usize]) -> Score {
        let mut score = Score::default();
        for (i, &a) in set.iter().enumerate() {
            for &b in &set[i + 1..] {
                score.links = score.links.saturating_add(u64::from(self.weight(a, b)));
                score.same_numa = score.same_numa.saturating_add(self.same_numa(a, b) as u64);
            }
        }
        score
    }

    /// One pair's combined value: weight first, NUMA as a tie-break (`scale` exceeds any
    /// set's count of same-NUMA pairs, so the order is lexicographic).
    fn value(&self, a: usize, b: usize, scale: u128) -> u128 {
        u128::from(self.weight(a, b)) * scale + self.same_numa(a, b) as u128
    }

    /// The best set of `size` devices from `available` that holds `must_include`. Indices out
    /// of range and repeats are ignored; must-include devices need not be in `available`.
    pub fn best(&self, available: &[usize], must_include: &[usize], size: usize) -> Selection {
        self.search(available, must_include, size, WORK_BUDGET)
    }

    fn search(
        &self,
        available: &[usize],
        must_include: &[usize],
        size: usize,
        budget: u64,
    ) -> Selection {
        let (must, candidates) = self.clean(available, must_include);
        let need = size.saturating_sub(must.len());
        if need == 0 || candidates.len() <= need {
            let mut devices = must;
            if need > 0 {
                devices.extend(candidates);
            }
            let score = self.score(&devices);
            return Selection {
                devices,
                score,
                exact: true,
            };
        }
        let problem = Problem::new(self, &must, &candidates);
        let (counts, exact) = problem.solve(need, budget);
        let mut chosen: Vec<usize> = Vec::with_capacity(need);
        for (class, &count) in problem.classes.iter().zip(&counts) {
            chosen.extend(class.members.iter().take(count));
        }
        chosen.sort_unstable();
        let mut devices = must;
        devices.extend(chosen);
        let score = self.score(&devices);
        Selection {
            devices,
            score,
            exact,
        }
    }

    /// Must-include devices (known, deduplicated, in order) and the other candidates
    /// (known, available, not must, ascending).
    fn clean(&self, available: &[usize], must_include: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let mut seen = vec![false; self.n];
        let mut must = Vec::new();
        for &d in must_include {
            if d < self.n && !seen[d] {
                seen[d] = true;
                must.push(d);
            }
        }
        let mut candidates = Vec::new();
        for &d in available {
            if d < self.n && !seen[d] {
                seen[d] = true;
                candidates.push(d);
            }
        }
        candidates.sort_unstable();
        (must, candidates)
    }
}

/// One request's candidates, by class.
struct Problem {
    classes: Vec<ClassInfo>,
    /// Combined pair value between classes (`c == d`: between two members of `c`).
    value: Vec<u128>,
    /// For each class, the other classes (and itself) by value, best first.
    neighbours: Vec<Vec<usize>>,
}

struct ClassInfo {
    /// Available members, ascending.
    members: Vec<usize>,
    /// Value of one member with every must-include device.
    fixed_gain: u128,
}

impl Problem {
    fn new(matrix: &PairMatrix, must: &[usize], candidates: &[usize]) -> Problem {
        let n = matrix.n as u128;
        let scale = n * n.saturating_sub(1) / 2 + 1;
        let mut by_class: Vec<Option<usize>> = vec![None; matrix.classes.len()];
        let mut classes: Vec<ClassInfo> = Vec::new();
        for &d in candidates {
            let k = matrix.class_of[d];
            match by_class[k] {
                Some(i) => classes[i].members.push(d),
                None => {
                    by_class[k] = Some(classes.len());
                    let fixed_gain = must.iter().map(|&m| matrix.value(d, m, scale)).sum();
                    classes.push(ClassInfo {
                        members: vec![d],
                        fixed_gain,
                    });
                }
            }
        }
        let m = classes.len();
        let mut value = vec![0u128; m * m];
        for c in 0..m {
            for d in 0..m {
                let (a, b) = (classes[c].members[0], classes[d].members.get(1));
                value[c * m + d] = if c == d {
                    b.map_or(0, |&b| matrix.value(a, b, scale))
                } else {
                    matrix.value(a, classes[d].members[0], scale)
                };
            }
        }
        let neighbours = (0..m)
            .map(|c| {
                let mut order: Vec<usize> = (0..m).collect();
                order.sort_by(|&x, &y| value[c * m + y].cmp(&value[c * m + x]));
                order
            })
            .collect();
        Problem {
            classes,
            value,
            neighbours,
        }
    }

    fn v(&self, c: usize, d: usize) -> u128 {
        self.value[c * self.classes.len() + d]
    }

    /// How many members to take from each class, and whether optimality was proven.
    fn solve(&self, need: usize, budget: u64) -> (Vec<usize>, bool) {
        let m = self.classes.len();
        let (greedy, greedy_value) = self.greedy(need);
        let mut search = Search {
            problem: self,
            counts: vec![0; m],
            gain: self.classes.iter().map(|c| c.fixed_gain).collect(),
            best: greedy,
            best_value: greedy_value,
            work: 0,
            budget,
            units: Vec::with_capacity(m),
        };
        search.dfs(0, need, 0);
        let exact = search.work <= budget;
        (search.best, exact)
    }

    /// Adds the member with the best marginal value, `need` times.
    fn greedy(&self, need: usize) -> (Vec<usize>, u128) {
        let m = self.classes.len();
        let mut counts = vec![0usize; m];
        let mut gain: Vec<u128> = self.classes.iter().map(|c| c.fixed_gain).collect();
        let mut total = 0u128;
        for _ in 0..need {
            let pick = (0..m)
                .filter(|&c| counts[c] < self.classes[c].members.len())
                .max_by(|&a, &b| gain[a].cmp(&gain[b]).then(b.cmp(&a)));
            let Some(c) = pick else { break };
            total += gain[c];
            counts[c] += 1;
            for (d, g) in gain.iter_mut().enumerate() {
                *g += self.v(c, d);
            }
        }
        (counts, total)
    }
}

struct Search<'a> {
    problem: &'a Problem,
    counts: Vec<usize>,
    /// Value one more member of each class would add, given the counts so far.
    gain: Vec<u128>,
    best: Vec<usize>,
    best_value: u128,
    /// Work done so far (see [`WORK_BUDGET`]).
    work: u64,
    budget: u64,
    units: Vec<(u128, usize)>,
}

impl Search<'_> {
    fn dfs(&mut self, t: usize, left: usize, value: u128) {
        let rest = self.problem.classes.len().saturating_sub(t) as u64;
        self.work += 1 + rest * rest;
        if self.work > self.budget {
            return;
        }
        if left == 0 {
            if value > self.best_value {
                self.best_value = value;
                self.best.clone_from(&self.counts);
            }
            return;
        }
        let m = self.problem.classes.len();
        if t == m || self.upper_bound(t, left, value) <= self.best_value {
            return;
        }
        let size = self.problem.classes[t].members.len();
        let room: usize = self.problem.classes[t + 1..]
            .iter()
            .map(|c| c.members.len())
            .sum();
        let low = left.saturating_sub(room);
        for take in (low..=size.min(left)).rev() {
            // Taking `take` members of class t: each adds its gain plus the pairs among them.
            let k = take as u128;
            let pairs = k * k.saturating_sub(1) / 2;
            let added = k * self.gain[t] + pairs * self.problem.v(t, t);
            self.counts[t] = take;
            for d in (t + 1)..m {
                self.gain[d] += k * self.problem.v(t, d);
            }
            self.dfs(t + 1, left - take, value + added);
            for d in (t + 1)..m {
                self.gain[d] -= k * self.problem.v(t, d);
            }
            self.counts[t] = 0;
            if self.work > self.budget {
                return;
            }
        }
    }

    /// An upper bound on the value after taking `left` more members from classes `t..`:
    /// each member adds at most its gain plus half of its `left - 1` best links among the
    /// remaining candidates; the sum of the `left` best such members bounds the rest.
    /// Computed doubled, to stay in integers.
    fn upper_bound(&mut self, t: usize, left: usize, value: u128) -> u128 {
        let p = self.problem;
        self.units.clear();
        for d in t..p.classes.len() {
            let mut links = 0u128;
            let mut want = left - 1;
            for &e in &p.neighbours[d] {
                if want == 0 {
                    break;
                }
                if e < t {
                    continue;
                }
                let mut have = p.classes[e].members.len();
                if e == d {
                    have -= 1;
                }
                let take = have.min(want);
                links += take as u128 * p.v(d, e);
                want -= take;
            }
            self.units
                .push((2 * self.gain[d] + links, p.classes[d].members.len()));
        }
        self.units.sort_unstable_by_key(|u| std::cmp::Reverse(u.0));
        let mut want = left;
        let mut bound = 2 * value;
        for &(unit, count) in &self.units {
            let take = count.min(want);
            bound += take as u128 * unit;
            want -= take;
            if want == 0 {
                break;
            }
        }
        bound / 2
    }
}

/// The reference answer: every subset of the right size, scored with [`PairMatrix::score`].
/// Exponential; for tests and the bench only.
pub fn brute_force(
    matrix: &PairMatrix,
    available: &[usize],
    must_include: &[usize],
    size: usize,
) -> Selection {
    let (must, candidates) = matrix.clean(available, must_include);
    let need = size.saturating_sub(must.len()).min(candidates.len());
    let mut best: Option<(Score, Vec<usize>)> = None;
    let mut pick: Vec<usize> = (0..need).collect();
    loop {
        let mut set = must.clone();
        set.extend(pick.iter().map(|&i| candidates[i]));
        let score = matrix.score(&set);
        if best.as_ref().is_none_or(|(s, _)| score > *s) {
            best = Some((score, set));
        }
        // Next combination in lexicographic order.
        let mut i = need;
        loop {
            if i == 0 {
                let (score, devices) = best.unwrap_or_default();
                return Selection {
                    devices,
                    score,
                    exact: true,
                };
            }
            i -= 1;
            if pick[i] < candidates.len() - need + i {
                break;
            }
        }
        pick[i] += 1;
        for j in (i + 1)..need {
            pick[j] = pick[j - 1] + 1;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A small deterministic generator (xorshift), so failures reproduce.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    fn random_matrix(rng: &mut Rng, n: usize, levels: u32) -> PairMatrix {
        let numa: Vec<Option<i64>> = (0..n)
            .map(|_| match rng.below(3) {
                0 => None,
                k => Some(k as i64 - 1),
            })
            .collect();
        let w: Vec<u32> = (0..n * n)
            .map(|_| (rng.next() % u64::from(levels)) as u32)
            .collect();
        PairMatrix::from_fn(numa, |a, b| w[a * n + b])
    }

    /// `gpus` GPUs of `parts` partitions each: partitions of one GPU are twins.
    fn partitioned(rng: &mut Rng, gpus: usize, parts: usize) -> PairMatrix {
        let gw: Vec<u32> = (0..gpus * gpus)
            .map(|_| 10 + rng.below(3) as u32 * 10)
            .collect();
        let numa = (0..gpus * parts)
            .map(|d| Some((d / parts * 2 / gpus) as i64))
            .collect();
        PairMatrix::from_fn(numa, |a, b| {
            let (ga, gb) = (a / parts, b / parts);
            if ga == gb {
                40
            } else {
                gw[ga.min(gb) * gpus + ga.max(gb)]
            }
        })
    }

    fn check_valid(sel: &Selection, available: &[usize], must: &[usize], size: usize, n: usize) {
        let mut seen = std::collections::HashSet::new();
        assert!(sel.devices.iter().all(|d| seen.insert(*d)), "no repeats");
        let must_known: Vec<usize> = {
            let mut s = std::collections::HashSet::new();
            must.iter()
                .copied()
                .filter(|&d| d < n && s.insert(d))
                .collect()
        };
        assert_eq!(
            &sel.devices[..must_known.len()],
            &must_known[..],
            "must first"
        );
        for d in &sel.devices[must_known.len()..] {
            assert!(available.contains(d), "{d} was not offered");
        }
        let offered: std::collections::HashSet<usize> = available
            .iter()
            .chain(&must_known)
            .copied()
            .filter(|&d| d < n)
            .collect();
        assert_eq!(
            sel.devices.len(),
            size.max(must_known.len()).min(offered.len()),
            "exactly the size asked when enough are offered, never padded"
        );
    }

    #[test]
    fn matches_brute_force_on_random_matrices() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..600 {
            let n = 1 + rng.below(12);
            let m = if round % 2 == 0 {
                let levels = 1 + rng.below(60) as u32;
                random_matrix(&mut rng, n, levels)
            } else {
                random_matrix(&mut rng, n, 3)
            };
            let available: Vec<usize> = (0..n).filter(|_| rng.below(4) != 0).collect();
            let must: Vec<usize> = (0..n).filter(|_| rng.below(6) == 0).collect();
            let size = rng.below(n + 2);
            let got = m.best(&available, &must, size);
            let want = brute_force(&m, &available, &must, size);
            check_valid(&got, &available, &must, size, n);
            assert_eq!(
                got.score, want.score,
                "round {round}: {m:?} {available:?} {must:?} {size}"
            );
            assert!(got.exact);
        }
    }

    #[test]
    fn matches_brute_force_with_twins() {
        let mut rng = Rng(12345);
        for round in 0..200 {
            let gpus = 2 + rng.below(3);
            let parts = 1 + rng.below(4);
            let m = partitioned(&mut rng, gpus, parts);
            let n = gpus * parts;
            assert!(m.class_count() <= gpus);
            let available: Vec<usize> = (0..n).filter(|_| rng.below(5) != 0).collect();
            let must: Vec<usize> = (0..n).filter(|_| rng.below(8) == 0).collect();
            let size = 1 + rng.below(n);
            let got = m.best(&available, &must, size);
            check_valid(&got, &available, &must, size, n);
            let want = brute_force(&m, &available, &must, size);
            assert_eq!(got.score, want.score, "round {round}");
        }
    }

    #[test]
    fn prefers_links_then_numa() {
        // 0-1 and 2-3 are linked (XGMI); 0,1,2 on NUMA 0, 3 on NUMA 1.
        let numa = vec![Some(0), Some(0), Some(0), Some(1)];
        let m = PairMatrix::from_fn(numa, |a, b| match (a, b) {
            (0, 1) | (2, 3) => 30,
            _ => 10,
        });
        let all = [0, 1, 2, 3];
        assert_eq!(m.best(&all, &[], 2).devices, [0, 1]);
        assert_eq!(
            m.best(&all, &[3], 2).devices,
            [3, 2],
            "must-include pulls its peer"
        );
        // Without link differences, NUMA decides: {0,1,2} share node 0.
        let flat = PairMatrix::from_fn(vec![Some(1), Some(0), Some(0), Some(0)], |_, _| 10);
        assert_eq!(flat.best(&all, &[], 3).devices, [1, 2, 3]);
        // Never padded: only offered devices, even if short.
        assert_eq!(m.best(&[1], &[], 3).devices, [1]);
        // Unknown indices are ignored.
        assert_eq!(m.best(&[7, 2], &[9], 1).devices, [2]);
    }

    #[test]
    fn mi300x_like_64_partitions_is_exact_and_groups_by_gpu() {
        // 8 GPUs, all XGMI-connected, 4 per NUMA node; 8 CPX partitions each.
        let numa = (0..64).map(|d| Some((d / 32) as i64)).collect();
        let m = PairMatrix::from_fn(numa, |a, b| if a / 8 == b / 8 { 40 } else { 30 });
        assert_eq!(m.class_count(), 8);
        let all: Vec<usize> = (0..64).collect();
        for size in 1..=64 {
            let sel = m.best(&all, &[], size);
            assert!(sel.exact, "size {size}");
            assert_eq!(sel.devices.len(), size);
            // Whole GPUs first, and within one NUMA node while it fits.
            let gpus: std::collections::BTreeSet<usize> =
                sel.devices.iter().map(|d| d / 8).collect();
            assert_eq!(
                gpus.len(),
                size.div_ceil(8),
                "size {size}: {:?}",
                sel.devices
            );
        }
        // Fragmented availability: every second partition is taken.
        let odd: Vec<usize> = (0..64).filter(|d| d % 2 == 1).collect();
        let sel = m.best(&odd, &[], 8);
        assert!(sel.exact);
        let gpus: std::collections::BTreeSet<usize> = sel.devices.iter().map(|d| d / 8).collect();
        assert_eq!(gpus.len(), 2);
    }

    #[test]
    fn budget_exhaustion_still_answers_validly() {
        let mut rng = Rng(77);
        let m = random_matrix(&mut rng, 14, 1000);
        let all: Vec<usize> = (0..14).collect();
        let sel = m.search(&all, &[], 7, 10);
        assert!(!sel.exact);
        check_valid(&sel, &all, &[], 7, 14);
        let full = m.best(&all, &[], 7);
        assert!(full.exact);
        assert!(full.score >= sel.score);
    }
}
