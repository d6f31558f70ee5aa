//! Host verifier negative tests: each program comes from text and each test asserts the
//! message and the location of the reported error.

mod common;

use common::{expect_diag, host_errors, host_text};

/// Declarations used by most tests (text lines 2 to 7).
const DECLS: [&str; 6] = [
    "mesh m0 = [0, 1, 2, 3]",
    "in x: f32[8, 4] on m0",
    "out y: f32[8, 4] on m0",
    "tensor t: f32[8, 4] on m0",
    "tensor v: f32[2, 4] on m0",
    "tensor ag: f32[32, 4] on m0",
];

/// `DECLS` then `body`: body line `k` is text line `k + 8`, column 3.
fn host(body: &[&str]) -> String {
    let mut lines: Vec<&str> = DECLS.to_vec();
    lines.extend_from_slice(body);
    host_text(&lines)
}

#[test]
fn read_before_allocate() {
    let text = host(&["copy(t -> y)"]);
    expect_diag(
        &host_errors(&text),
        "tensor `t` is read by `copy(t -> y)` before it is allocated",
        8,
        3,
    );
}

#[test]
fn write_after_deallocate() {
    let text = host(&["allocate t", "deallocate t", "gelu(x -> t)"]);
    expect_diag(
        &host_errors(&text),
        "tensor `t` is written by `gelu(x -> t)` after it is deallocated",
        10,
        3,
    );
}

#[test]
fn allocated_output_used_before_its_allocate() {
    let text = host(&["gelu(x -> y)", "allocate y"]);
    expect_diag(
        &host_errors(&text),
        "tensor `y` is written by `gelu(x -> y)` before it is allocated",
        8,
        3,
    );
}

#[test]
fn allocate_an_input() {
    let text = host(&["allocate x"]);
    expect_diag(&host_errors(&text), "cannot allocate input `x`", 8, 3);
}

#[test]
fn allocate_twice() {
    let text = host(&["allocate t", "allocate t", "deallocate t"]);
    expect_diag(
        &host_errors(&text),
        "`t` is allocated twice without a deallocate (first allocated at 8:3)",
        9,
        3,
    );
}

#[test]
fn deallocate_what_is_not_allocated() {
    let text = host(&["deallocate t"]);
    expect_diag(
        &host_errors(&text),
        "deallocate of `t`, which is not allocated",
        8,
        3,
    );
}

#[test]
fn deallocate_an_input() {
    let text = host(&["deallocate x"]);
    expect_diag(&host_errors(&text), "cannot deallocate input `x`", 8, 3);
}

#[test]
fn allocation_in_a_loop_body_must_be_freed_there() {
    let text = host(&[
        "for i0 in 0..2 {",
        "  allocate t",
        "  gelu(x -> t)",
        "}",
        "deallocate t",
    ]);
    expect_diag(
        &host_errors(&text),
        "`t` is allocated in the body of `for i0 in 0..2 { ... }` but not deallocated in it",
        9,
        5,
    );
}

#[test]
fn deallocate_in_a_loop_what_was_allocated_outside() {
    let text = host(&["allocate t", "for i0 in 0..2 {", "  deallocate t", "}"]);
    expect_diag(
        &host_errors(&text),
        "`t` is deallocated inside a loop but allocated outside it",
        10,
        5,
    );
}

#[test]
fn view_used_before_its_shard_by_stream() {
    let text = host(&[
        "copy(v -> y)",
        "v = shard_by_stream(x, axis=0, chunks=4, index=0)",
    ]);
    expect_diag(
        &host_errors(&text),
        "view `v` is read by `copy(v -> y)` before its `shard_by_stream`",
        8,
        3,
    );
}

#[test]
fn view_used_outside_its_loop() {
    let text = host(&[
        "for i0 in 0..4 {",
        "  v = shard_by_stream(x, axis=0, chunks=4, index=i0)",
        "}",
        "gelu(v -> y)",
    ]);
    expect_diag(
        &host_errors(&text),
        "view `v` is read by `gelu(v -> y)` outside the block of its `shard_by_stream`",
        11,
        3,
    );
}

#[test]
fn allocate_a_view() {
    let text = host(&[
        "allocate v",
        "v = shard_by_stream(x, axis=0, chunks=4, index=0)",
    ]);
    expect_diag(
        &host_errors(&text),
        "cannot allocate view `v`: it is defined by `shard_by_stream`",
        8,
        3,
    );
}

#[test]
fn shard_by_stream_chunks_must_divide() {
    let text = host(&["v = shard_by_stream(x, axis=0, chunks=3, index=0)"]);
    expect_diag(
        &host_errors(&text),
        "axis 0 of `x` has extent 8, which is not divisible into 3 chunks",
        8,
        3,
    );
}

#[test]
fn shard_by_stream_view_shape() {
    let text = host(&["v = shard_by_stream(x, axis=0, chunks=2, index=0)"]);
    expect_diag(
        &host_errors(&text),
        "view `v` has shape [2, 4] but a chunk of `x` along axis 0 has shape [4, 4]",
        8,
        3,
    );
}

#[test]
fn shard_by_stream_axis_and_index_out_of_range() {
    let text = host(&[
        "v = shard_by_stream(x, axis=2, chunks=4, index=0)",
        "v = shard_by_stream(x, axis=0, chunks=4, index=5)",
    ]);
    let diags = host_errors(&text);
    expect_diag(
        &diags,
        "axis 2 is out of range for `x` of shape [8, 4]",
        8,
        3,
    );
    expect_diag(&diags, "index 5 is out of range for 4", 9, 3);
}

#[test]
fn loop_variable_outside_its_loop() {
    let text = host(&[
        "for i0 in 0..4 {",
        "}",
        "v = shard_by_stream(x, axis=0, chunks=4, index=i0)",
    ]);
    expect_diag(
        &host_errors(&text),
        "loop variable `i0` is used outside its loop",
        10,
        3,
    );
}

#[test]
fn shadowed_loop_variable() {
    let text = host(&["for i0 in 0..4 {", "  for i0 in 0..2 {", "  }", "}"]);
    expect_diag(
        &host_errors(&text),
        "loop variable `i0` shadows an enclosing loop's variable",
        9,
        5,
    );
}

#[test]
fn stream_used_before_it_is_saved() {
    let text = host(&["set_current_stream s1", "s1 = get_current_stream"]);
    expect_diag(
        &host_errors(&text),
        "stream `s1` is used before `s1 = get_current_stream`",
        8,
        3,
    );
}

#[test]
fn duplicate_communication_label() {
    let text = host(&[
        "allocate ag",
        "c0 = all_gather(x -> ag, team=slice(m0, DIDx))",
        "c0 = all_gather(x -> ag, team=slice(m0, DIDx))",
        "wait c0",
    ]);
    expect_diag(
        &host_errors(&text),
        "communication label `c0` is already defined (at 9:3)",
        10,
        3,
    );
}

#[test]
fn wait_without_its_communication() {
    let text = host(&[
        "allocate ag",
        "for i0 in 0..2 {",
        "  c0 = all_gather(x -> ag, team=slice(m0, DIDx))",
        "}",
        "wait c0",
        "wait c7",
    ]);
    let diags = host_errors(&text);
    expect_diag(
        &diags,
        "a Wait without its communication: `c0` is not defined",
        12,
        3,
    );
    expect_diag(
        &diags,
        "a Wait without its communication: `c7` is not defined",
        13,
        3,
    );
}

#[test]
fn root_and_op_rules() {
    let text = host(&[
        "allocate t",
        "c0 = broadcast(x -> t, team=slice(m0, DIDx))",
        "c1 = all_gather(x -> ag, team=slice(m0, DIDx), root=0)",
        "c2 = all_reduce(x -> t, team=slice(m0, DIDx))",
        "c3 = broadcast(x -> t, team=slice(m0, DIDx), root=0, op=sum)",
        "c4 = broadcast(x -> t, team=slice(m0, DIDx), root=4)",
    ]);
    let diags = host_errors(&text);
    expect_diag(&diags, "`broadcast` needs `root=`", 9, 3);
    expect_diag(&diags, "`all_gather` takes no `root`", 10, 3);
    expect_diag(&diags, "`all_reduce` needs `op=`", 11, 3);
    expect_diag(&diags, "`broadcast` takes no `op`", 12, 3);
    expect_diag(&diags, "root 4 is out of range for 4", 13, 3);
}

#[test]
fn team_slice_needs_the_mesh_axis() {
    let text = host(&[
        "allocate t",
        "c0 = all_reduce(x -> t, team=slice(m0, DIDy), op=sum)",
    ]);
    expect_diag(
        &host_errors(&text),
        "team `slice(m0, DIDy)`: mesh `m0` has 1 axis, so it has no DIDy",
        9,
        3,
    );
}

#[test]
fn team_flattened_needs_two_ordered_axes_of_the_mesh() {
    let flat = |team: &str| {
        host_text(&[
            "mesh m0 = [[0, 1], [2, 3]]",
            "in x: f32[8, 4] on m0",
            "tensor t: f32[8, 4] on m0",
            "allocate t",
            &format!("c0 = all_reduce(x -> t, team={team}, op=sum)"),
        ])
    };
    for (team, msg) in [
        (
            "flattened(m0, DIDx)",
            "team `flattened(m0, DIDx)` flattens 1 parallel type(s); it needs at least two",
        ),
        (
            "flattened(m0, DIDx, DIDy)",
            "team `flattened(m0, DIDx, DIDy)`: the parallel types must be distinct and listed \
             outermost mesh axis first",
        ),
        (
            "flattened(m0, DIDz, DIDx)",
            "team `flattened(m0, DIDz, DIDx)`: mesh `m0` has 2 axes, so it has no DIDz",
        ),
        (
            "flattened(m0, Stream, DIDx)",
            "team `flattened(m0, Stream, DIDx)`: Stream is not a device parallel type",
        ),
    ] {
        expect_diag(&host_errors(&flat(team)), msg, 6, 3);
    }
    // Over both axes of a 2x2 mesh: a team of 4, and an all-gather needs 4 slots.
    let ok = host_text(&[
        "mesh m0 = [[0, 1], [2, 3]]",
        "in x: f32[2, 4] on m0",
        "out y: f32[8, 4] on m0",
        "c0 = all_gather(x -> y, team=flattened(m0, DIDy, DIDx))",
        "wait c0",
    ]);
    let p = meshflow_ir::parse_host(&ok).expect("parses");
    assert!(meshflow_ir::verify_host(&p).is_ok(), "{ok}");
    assert_eq!(
        p.to_string().matches("flattened(m0, DIDy, DIDx)").count(),
        1
    );
}

#[test]
fn team_devices_must_be_unique() {
    let text = host(&[
        "allocate t",
        "c0 = all_reduce(x -> t, team=devices(2, 2), op=sum)",
    ]);
    expect_diag(
        &host_errors(&text),
        "device 2 appears twice in the team",
        9,
        3,
    );
}

#[test]
fn all_gather_buffer_sizes() {
    let text = host(&[
        "allocate t",
        "c0 = all_gather(x -> t, team=slice(m0, DIDx))",
    ]);
    expect_diag(
        &host_errors(&text),
        "`all_gather` over a team of 4 needs its output to hold 4 × 32 = 128 elements (`x` has 32), but `t` has 32",
        9,
        3,
    );
}

#[test]
fn reduce_scatter_and_all_to_all_sizes() {
    let text = host(&[
        "allocate t",
        "c0 = reduce_scatter(x -> t, team=slice(m0, DIDx), op=sum)",
        "c1 = all_to_all(v -> v, team=devices(0, 1, 2))",
    ]);
    let diags = host_errors(&text);
    expect_diag(
        &diags,
        "`reduce_scatter` over a team of 4 needs its input to hold 4 × 32 = 128 elements (`t` has 32), but `x` has 32",
        9,
        3,
    );
    expect_diag(
        &diags,
        "`all_to_all` needs `v` to split into 3 equal chunks, but it has 8 elements",
        10,
        3,
    );
}

#[test]
fn send_recv_needs_two_devices_and_equal_dtypes() {
    let text = host(&[
        "tensor h: bf16[8, 4] on m0",
        "allocate h",
        "c0 = send_recv(x -> h, team=devices(0, 1, 2), root=0)",
    ]);
    let diags = host_errors(&text);
    expect_diag(
        &diags,
        "`send_recv` needs a team of 2 devices, this team has 3",
        10,
        3,
    );
    expect_diag(
        &diags,
        "`send_recv` needs equal dtypes, but `x` is f32 and `h` is bf16",
        10,
        3,
    );
}

#[test]
fn collective_permute_sizes() {
    let text = host(&[
        "allocate ag",
        "c0 = collective_permute(x -> ag, team=slice(m0, DIDx), send=0, recv=9)",
    ]);
    let diags = host_errors(&text);
    expect_diag(
        &diags,
        "`collective_permute` needs `x` and `ag` to have the same number of elements, 32 and 128",
        9,
        3,
    );
    expect_diag(&diags, "recv peer 9 is out of range for 4", 9, 3);
}

#[test]
fn moe_dispatch_shapes() {
    let text = host_text(&[
        "mesh m0 = [0, 1]",
        "in x: f32[6, 16] on m0",
        "in idx: i32[6, 2] on m0",
        "out ex: f32[2, 12, 16] on m0",
        "out counts: i32[3] on m0",
        "out routing: i64[2, 12, 2] on m0",
        "c0 = moe_dispatch(x, idx -> ex, counts, routing, team=slice(m0, DIDx))",
        "wait c0",
    ]);
    let diags = host_errors(&text);
    expect_diag(
        &diags,
        "`moe_dispatch`: `counts` must have shape [2] ([B.., L]), has [3]",
        8,
        3,
    );
    expect_diag(
        &diags,
        "`moe_dispatch`: `routing` must be i32, is i64",
        8,
        3,
    );
}

#[test]
fn moe_dispatch_fp8_needs_divisible_widths() {
    let text = host_text(&[
        "mesh m0 = [0, 1]",
        "in x: bf16[6, 48] on m0",
        "in idx: i32[6, 2] on m0",
        "out ex: bf16[2, 12, 48] on m0",
        "out counts: i32[2] on m0",
        "out routing: i32[2, 12, 2] on m0",
        "c0 = moe_dispatch(x, idx -> ex, counts, routing, team=slice(m0, DIDx), wire=f8e4m3, scale=block128)",
        "wait c0",
    ]);
    expect_diag(
        &host_errors(&text),
        "`moe_dispatch`: `x`: FP8 dispatch with block128 scales needs a token width divisible \
         by 128, the tokens have 48 channels",
        8,
        3,
    );
    let token = text.replace("scale=block128", "scale=token");
    assert!(meshflow_ir::verify_host(&meshflow_ir::parse_host(&token).unwrap()).is_ok());
}

#[test]
fn moe_combine_shapes() {
    let text = host_text(&[
        "mesh m0 = [0, 1]",
        "in ey: f32[2, 12, 8] on m0",
        "in counts: i32[2] on m0",
        "in routing: i32[2, 12, 2] on m0",
        "in w: f32[6, 2] on m0",
        "out y: f32[6, 16] on m0",
        "c0 = moe_combine(ey, counts, routing, w -> y, team=slice(m0, DIDx))",
    ]);
    expect_diag(
        &host_errors(&text),
        "`moe_combine`: `y` must have shape [6, 8] ([B.., T, F]), has [6, 16]",
        8,
        3,
    );
}

#[test]
fn compute_shapes_and_arity() {
    let text = host(&[
        "tensor w: f32[5, 3] on m0",
        "allocate t",
        "linear(x, w -> t)",
        "add(x -> t)",
        "permute(x -> t, perm=[0, 0])",
        "sum(x -> t, axis=1)",
    ]);
    let diags = host_errors(&text);
    expect_diag(
        &diags,
        "`linear`: contraction extents differ: `x` [8, 4] has K=4, `w` [5, 3] has K=3",
        10,
        3,
    );
    expect_diag(
        &diags,
        "`add` takes 2 inputs and 1 output, given 1 input and 1 output",
        11,
        3,
    );
    expect_diag(
        &diags,
        "`permute`: perm [0, 0] is not a permutation of the 2 axes of `x`",
        12,
        3,
    );
    expect_diag(
        &diags,
        "`sum`: output `t` must have shape [8], has [8, 4]",
        13,
        3,
    );
}

#[test]
fn my_needs_the_mesh_axis() {
    let text = host(&["set_current_stream worker(my(m0, DIDy))"]);
    expect_diag(
        &host_errors(&text),
        "`my(m0, DIDy)`: mesh `m0` has 1 axis, so it has no DIDy",
        8,
        3,
    );
}

#[test]
fn coalescing_rules() {
    let text = host(&[
        "allocate t",
        "start_coalescing",
        "start_coalescing",
        "deallocate t",
        "c0 = end_coalescing",
        "c1 = end_coalescing",
        "start_coalescing",
    ]);
    let diags = host_errors(&text);
    expect_diag(
        &diags,
        "nested `start_coalescing`: a coalescing group is already open",
        10,
        3,
    );
    expect_diag(
        &diags,
        "`deallocate t` is inside a coalescing group; only communications may be",
        11,
        3,
    );
    expect_diag(
        &diags,
        "`end_coalescing` without a `start_coalescing` in the same block",
        13,
        3,
    );
    expect_diag(
        &diags,
        "`start_coalescing` has no `end_coalescing` in the same block",
        14,
        3,
    );
}

#[test]
fn keyword_and_duplicate_names() {
    let text = host_text(&[
        "mesh m0 = [0, 1]",
        "in wait: f32[4] on m0",
        "tensor m0: f32[4] on m0",
    ]);
    let diags = host_errors(&text);
    expect_diag(&diags, "`wait` is a keyword and cannot name a tensor", 3, 3);
    expect_diag(
        &diags,
        "name `m0` is already used by mesh `m0` (declared at 2:3)",
        4,
        3,
    );
}

#[test]
fn every_error_is_reported() {
    let text = host(&[
        "copy(t -> y)",
        "allocate x",
        "for i0 in 0..2 {",
        "  for i0 in 0..2 {",
        "  }",
        "}",
        "wait c3",
        "synchronize s2",
        "c0 = all_reduce(x -> y, team=slice(m0, DIDz), op=max)",
    ]);
    let diags = host_errors(&text);
    expect_diag(
        &diags,
        "tensor `t` is read by `copy(t -> y)` before it is allocated",
        8,
        3,
    );
    expect_diag(&diags, "cannot allocate input `x`", 9, 3);
    expect_diag(&diags, "loop variable `i0` shadows", 11, 5);
    expect_diag(&diags, "a Wait without its communication", 14, 3);
    expect_diag(&diags, "stream `s2` is used before", 15, 3);
    expect_diag(&diags, "team `slice(m0, DIDz)`", 16, 3);
    assert_eq!(diags.len(), 6, "{diags:#?}");
}

#[test]
fn narrow_view_shape_and_bounds() {
    // A narrow keeps every other extent; its capacity lies within the viewed extent.
    let text = host(&[
        "allocate t",
        "v = narrow(t, axis=1, start=0, length=2)",
        "deallocate t",
    ]);
    expect_diag(
        &host_errors(&text),
        "view `v` has shape [2, 4] but a narrowing of `t` (shape [8, 4]) along axis 1 keeps every other extent",
        9,
        3,
    );
    let text = host(&[
        "allocate t",
        "v = narrow(t, axis=0, start=7, length=2)",
        "deallocate t",
    ]);
    expect_diag(
        &host_errors(&text),
        "elements [7, 7 + 2) along axis 0 do not fit `t` (extent 8)",
        9,
        3,
    );
    // Per-rank bounds are fine: they are checked across ranks and at run time.
    let ok = host(&[
        "allocate t",
        "v = narrow(t, axis=0, start=0, length=min(2, 8 - 2 * my(m0, DIDx)))",
        "copy(v -> v)",
        "deallocate t",
    ]);
    let program = meshflow_ir::parse_host(&ok).expect("parses");
    assert!(meshflow_ir::verify_host(&program).is_ok(), "{ok}");
}

/// Regression: top-k routing to more experts than the team holds was caught only when the
/// program ran.
#[test]
fn moe_dispatch_top_k_beyond_the_experts() {
    let text = host_text(&[
        "mesh m0 = [0, 1]",
        "in x: f32[6, 16] on m0",
        "in idx: i32[6, 5] on m0",
        "out ex: f32[2, 12, 16] on m0",
        "out counts: i32[2] on m0",
        "out routing: i32[2, 12, 2] on m0",
        "c0 = moe_dispatch(x, idx -> ex, counts, routing, team=slice(m0, DIDx))",
        "wait c0",
    ]);
    expect_diag(
        &host_errors(&text),
        "`moe_dispatch`: top-5 routing (`idx` has K = 5) needs at least 5 experts, but the team \
         of 2 holds 2 each (4 in all)",
        8,
        3,
    );
}

#[test]
fn linear_accumulate_reads_its_output_and_checks_shapes_like_linear() {
    // The accumulating linear reads its output: before the allocate it is a read.
    let text = host(&["tensor w: f32[4, 4] on m0", "linear_accumulate(x, w -> t)"]);
    expect_diag(
        &host_errors(&text),
        "tensor `t` is read by `linear_accumulate(x, w -> t)` before it is allocated",
        9,
        3,
    );
    let text = host(&[
        "tensor w: f32[5, 3] on m0",
        "allocate t",
        "linear_accumulate(x, w -> t)",
    ]);
    expect_diag(
        &host_errors(&text),
        "`linear_accumulate`: contraction extents differ: `x` [8, 4] has K=4, `w` [5, 3] has K=3",
        10,
        3,
    );
}
