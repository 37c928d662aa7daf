//! The kernel, as PTX text written by hand: `y[i] = a * x[i] + y[i]` for `i < n` (SAXPY), one
//! thread per element. The driver's JIT (`cuModuleLoadDataEx`) compiles it for whatever GPU
//! runs it, so no CUDA compiler is needed to build this program.
//!
//! Its parameters are, in order, `n: u32`, `a: f32`, `x: *const f32`, `y: *mut f32`;
//! [`crate::driver::Cuda::launch_saxpy`] passes exactly these (a test below reads them back
//! from the text).

/// The kernel's entry name.
pub const KERNEL: &str = "saxpy";

/// PTX ISA 6.4 (CUDA 10.0) for `sm_75` (Turing), the oldest GPU CUDA 13 drivers still
/// compile for; the JIT compiles it for any newer GPU.
pub const SAXPY: &str = r#".version 6.4
.target sm_75
.address_size 64

.visible .entry saxpy(
	.param .u32 saxpy_param_n,
	.param .f32 saxpy_param_a,
	.param .u64 saxpy_param_x,
	.param .u64 saxpy_param_y
)
{
	.reg .pred 	%p<2>;
	.reg .f32 	%f<5>;
	.reg .b32 	%r<6>;
	.reg .b64 	%rd<8>;

	ld.param.u32 	%r1, [saxpy_param_n];
	ld.param.f32 	%f1, [saxpy_param_a];
	ld.param.u64 	%rd1, [saxpy_param_x];
	ld.param.u64 	%rd2, [saxpy_param_y];
	mov.u32 	%r2, %ctaid.x;
	mov.u32 	%r3, %ntid.x;
	mov.u32 	%r4, %tid.x;
	mad.lo.s32 	%r5, %r2, %r3, %r4;
	setp.ge.u32 	%p1, %r5, %r1;
	@%p1 bra 	DONE;
	cvta.to.global.u64 	%rd3, %rd1;
	cvta.to.global.u64 	%rd4, %rd2;
	mul.wide.u32 	%rd5, %r5, 4;
	add.s64 	%rd6, %rd3, %rd5;
	add.s64 	%rd7, %rd4, %rd5;
	ld.global.f32 	%f2, [%rd6];
	ld.global.f32 	%f3, [%rd7];
	fma.rn.f32 	%f4, %f1, %f2, %f3;
	st.global.f32 	[%rd7], %f4;
DONE:
	ret;
}
"#;

/// The kernel's parameters as the PTX declares them: `(type, name)`, in order.
#[cfg(test)]
fn parameters(ptx: &str) -> Vec<(String, String)> {
    let Some(start) = ptx.find(".entry") else {
        return Vec::new();
    };
    let rest = &ptx[start..];
    let (Some(open), Some(close)) = (rest.find('('), rest.find(')')) else {
        return Vec::new();
    };
    rest.get(open + 1..close)
        .unwrap_or("")
        .split(',')
        .filter_map(|p| {
            let words: Vec<&str> = p.split_whitespace().collect();
            match words.as_slice() {
                [".param", ty, name] => Some((ty.to_string(), name.to_string())),
                _ => None,
            }
        })
        .collect()
}

/// The value the kernel leaves in `y[i]` for the inputs [`inputs`] makes, computed here.
pub fn expected(a: f32, i: u32) -> f32 {
    let (x, y) = inputs(i);
    a.mul_add(x, y)
}

/// The inputs at index `i`: `x[i] = i`, `y[i] = 1`, exact in `f32` (below 2^24), so the
/// GPU's result must equal [`expected`] bit for bit.
pub fn inputs(i: u32) -> (f32, f32) {
    // Exact: the element counts used stay below 2^24.
    #[allow(clippy::cast_precision_loss)]
    let x = i as f32;
    (x, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_parameters_are_the_ones_the_launch_passes() {
        assert_eq!(
            parameters(SAXPY),
            [
                (".u32", "saxpy_param_n"),
                (".f32", "saxpy_param_a"),
                (".u64", "saxpy_param_x"),
                (".u64", "saxpy_param_y"),
            ]
            .map(|(t, n)| (t.to_owned(), n.to_owned()))
        );
        assert!(SAXPY.contains(&format!(".visible .entry {KERNEL}(")));
    }

    #[test]
    fn the_ptx_is_well_formed_text() {
        assert!(SAXPY.is_ascii());
        assert!(!SAXPY.contains('\0'), "passed to the driver as a C string");
        assert!(SAXPY.starts_with(".version "));
        for directive in [".target sm_", ".address_size 64"] {
            assert!(SAXPY.contains(directive), "{directive}");
        }
        assert_eq!(SAXPY.matches('{').count(), SAXPY.matches('}').count());
        assert_eq!(SAXPY.matches('(').count(), SAXPY.matches(')').count());
        // Every instruction line ends with `;`, every label with `:`.
        let body = &SAXPY[SAXPY.find('{').unwrap_or(0) + 1..SAXPY.rfind('}').unwrap_or(0)];
        for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
            assert!(line.ends_with(';') || line.ends_with(':'), "{line}");
        }
    }

    /// Each register used is one the kernel declares (`%r<6>` declares `%r0`..`%r5`).
    #[test]
    fn every_register_used_is_declared() {
        let declared = |prefix: &str| -> usize {
            let decl = format!("%{prefix}<");
            let at = SAXPY.find(&decl).map(|i| i + decl.len()).unwrap_or(0);
            SAXPY[at..]
                .split('>')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        for prefix in ["p", "f", "r", "rd"] {
            let count = declared(prefix);
            assert!(count > 0, "%{prefix} declared");
            let needle = format!("%{prefix}");
            for (at, _) in SAXPY.match_indices(&needle) {
                let digits: String = SAXPY[at + needle.len()..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                if let Ok(n) = digits.parse::<usize>() {
                    assert!(n < count, "%{prefix}{n} beyond %{prefix}<{count}>");
                }
            }
        }
    }

    #[test]
    fn the_expected_values_are_exact() {
        assert_eq!(expected(2.0, 0), 1.0);
        assert_eq!(expected(2.0, 3), 7.0);
        assert_eq!(expected(2.0, (1 << 20) - 1), 2_097_151.0);
    }
}
