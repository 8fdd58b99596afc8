"""stepgraph/bench/kernel_trace.py without a GPU: the kernel families of representative names
(stepgraph's .cu kernels, cuDNN's, cuBLAS's, ATen's, inductor's triton kernels, as CUPTI
reports them), the per-step summary of a synthetic event list, and the comparison table."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from stepgraph.bench import kernel_trace as kt

ROOT = Path(__file__).resolve().parents[2]

NAMES = {
    # stepgraph (stepgraph/backends/cuda/**.cu; templated ones as CUPTI demangles them)
    "conv2d_tiled_kernel<float>": "conv fprop",
    "void conv2d_im2col_kernel<float>(float const*, float*, int, int)": "conv fprop",
    "conv2d_direct_forward_kernel<__nv_bfloat16>": "conv fprop",
    "conv2d_tiled_grad_weight_kernel<float>": "conv wgrad",
    "conv2d_direct_grad_weight_sum_kernel<float>": "conv wgrad",
    "conv2d_grad_weight_gather_kernel<float>": "conv wgrad",
    "conv2d_direct_grad_input_kernel<float>": "conv dgrad",
    "conv2d_col2im_kernel<float>": "conv dgrad",
    "conv2d_bias_act_kernel<float>": "pointwise",
    "tile_matmul_kernel": "gemm",
    "tile_matmul_finish_kernel": "gemm",
    "small_matmul_warp_kernel<float>": "gemm",
    "sdpa_forward_kernel<float, 64>": "attention",
    "sdpa_backward_dkdv_kernel<__nv_bfloat16, 64>": "attention",
    "sdpa_dropout_seed_kernel": "attention",
    "softmax_scaled_forward_kernel<float>": "softmax",
    "log_softmax_backward_kernel<float>": "softmax",
    "batch_norm_stats_planes_vec4_kernel<float>": "norm",
    "batch_norm_grad_finalize_kernel": "norm",
    "running_stats_update_kernel": "norm",
    "layer_norm_forward_kernel<float, 4>": "norm",
    "add_layer_norm_backward_loop_kernel<float>": "norm",
    "rms_norm_forward_kernel<float, 4>": "norm",
    "sgd_update_kernel": "optimizer",
    "adam_update_kernel": "optimizer",
    "lr_schedule_kernel": "optimizer",
    "advance_step_kernel": "optimizer",
    "global_norm_forward_kernel": "optimizer",
    "loss_scale_update_kernel": "optimizer",
    "cross_entropy_train_kernel<float>": "loss",
    "nll_loss_backward_kernel<float>": "loss",
    "mse_forward_kernel<float>": "loss",
    "maxpool2d_backward_tiling_nhwc_kernel<float>": "pool / resize",
    "avgpool2d_forward_warp_kernel<float>": "pool / resize",
    "reduce_sum_planes_kernel<float>": "reduction",
    "reduce_sum_splits_kernel<float>": "reduction",
    "reduce_max_rows_kernel<float>": "reduction",
    "cumsum_forward_kernel<float>": "reduction",
    "topk_forward_kernel<float>": "reduction",
    "pointwise_vec4_kernel": "pointwise",
    "pointwise_kernel": "pointwise",
    "binary_broadcast_kernel<float, 4>": "pointwise",
    "act_backward_kernel<float>": "pointwise",
    "fill_forward_kernel<unsigned int>": "pointwise",
    "dropout_forward_kernel<float>": "pointwise",
    "linear_bias_act_kernel<float>": "pointwise",
    "random_normal_kernel": "pointwise",
    "strided_copy_kernel<float, 4>": "copy / layout",
    "transpose_forward_kernel<float>": "copy / layout",
    "concat_forward_kernel<float>": "copy / layout",
    "cast_forward_kernel<float, __nv_bfloat16>": "copy / layout",
    "embedding_forward_kernel<float>": "copy / layout",
    "gather_backward_kernel<float>": "copy / layout",
    "weight_copies_permute_kernel": "copy / layout",
    "guard_check_kernel": "other",
    "lstm_cell_forward_kernel": "other",
    # cuDNN
    "sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32_warpgroup"
    "size1x1x1_g1_execute_segment_k_off_kernel__5x_cudnn": "conv fprop",
    "sm80_xmma_dgrad_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize64x64x64"
    "_stage4_warpsize2x2x1_g1_tensor16x8x8_execute_kernel__5x_cudnn": "conv dgrad",
    "sm80_xmma_wgrad_implicit_gemm_indexed_wo_smem_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize"
    "128x32x32_stage4_warpsize4x1x1_g1_tensor16x8x8_execute_kernel__5x_cudnn": "conv wgrad",
    "sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16"
    "_stage4_warpsize2x2x1_g1_tensor16x8x8_execute_kernel__5x_cudnn": "conv fprop",
    "void cudnn::cnn::wgrad2d_grouped_direct_kernel<false, true, int, float, float, float>"
    "(cudnn::cnn::WgradGroupedDirectParams, float const*, float const*, float*, float, float)":
        "conv wgrad",
    "void cudnn::detail::dgrad_engine<float, 128, 6, 7, 3, 3, 5, false>(int, int, int, "
    "float const*, int, float const*, int, float*, kernel_grad_params, unsigned long long, "
    "int, unsigned long long, int, float, int, int, int)": "conv dgrad",
    "void implicit_convolve_sgemm<float, float, 1024, 5, 5, 3, 3, 3, 1, false, false, true>"
    "(int, int, int, float const*, int, float*, float const*, kernel_conv_params, "
    "unsigned long long, int, float, float, int, float const*, float const*, bool, int, int)":
        "conv fprop",
    "cudnn_infer_ampere_scudnn_winograd_128x128_ldg1_ldg4_relu_tile148t_nt_v1": "conv fprop",
    "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1, true>"
    "(cudnnTensorStruct, float const*, cudnnTensorStruct, float*, float const*, float const*, "
    "float, float, float*, float*, float*, float*, float, float)": "norm",
    "void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 512, true, 1>(float, float, float, "
    "float, cudnnTensorStruct, float const*, cudnnTensorStruct, float const*, "
    "cudnnTensorStruct, float*, float const*, float*, float*, float const*, float const*, "
    "float)": "norm",
    "void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true, "
    "(cudnnKernelDataType_t)2>(cudnn::engines_precompiled::nchw2nhwc_params_t<float>, "
    "float const*, float*)": "copy / layout",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1"
    "_kernel0_0": "attention",
    "void cudnn::fusion::matmul_dq<true, 64>(void const*, void const*, void*, unsigned int, "
    "unsigned int)": "attention",
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, "
    "void*, void*, unsigned int)": "attention",
    # cuBLAS / cuBLASLt / CUTLASS
    "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1"
    "_execute_segment_k_off_kernel__5x_cublas": "gemm",
    "nvjet_tst_128x192_64x4_1x2_h_bz_coopA_TNN": "gemm",
    "ampere_sgemm_128x64_tn": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4>"
    "(cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4::Params)": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, true, "
    "false, false>(cublasLt::cublasSplitKParams<float>, float const*, float const*, "
    "float*, float const*, float const*, float const*, float const*, float*, void*, long, "
    "float*, int*)": "gemm",
    "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, "
    "false, cublasGemvParamsEx<int, cublasGemvTensorStrided<float const>, "
    "cublasGemvTensorStrided<float const>, cublasGemvTensorStrided<float>, float> >"
    "(cublasGemvParamsEx<int, cublasGemvTensorStrided<float const>, "
    "cublasGemvTensorStrided<float const>, cublasGemvTensorStrided<float>, float>, float, "
    "float)": "gemm",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, "
    "int, int>, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::"
    "MainloopSm90TmaGmmaWarpSpecialized<4, cute::tuple<cute::C<2>, cute::C<1>, cute::C<1> >, "
    "cutlass::gemm::KernelTmaWarpSpecializedCooperative>, cute::SM90_TMA_LOAD, "
    "cute::AutoVectorizingCopyWithAssumedAlignment<128> > > >(cutlass::gemm::kernel::"
    "GemmUniversal<...>::Params)": "gemm",
    # ATen
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
    "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, "
    "at::detail::Array<char*, 3>)": "pointwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, "
    "at::detail::Array<char*, 1>)": "pointwise",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
    "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()()"
    " const::{lambda()#7}::operator()() const::{lambda(float)#1}>(at::TensorIteratorBase&, "
    "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()()"
    " const::{lambda()#7}::operator()() const::{lambda(float)#1} const&)::{lambda(int)#1}>"
    "(int, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() "
    "const::{lambda(float)#1}>(at::TensorIteratorBase&, at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() "
    "const::{lambda(float)#1} const&)::{lambda(int)#1})": "copy / layout",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native::(anonymous"
    " namespace)::OpaqueType<4u>, unsigned int, 2, 128, 1>(at::native::(anonymous namespace)"
    "::OpaqueType<4u>*, at::native::(anonymous namespace)::CatArrInputTensorMetadata<"
    "at::native::(anonymous namespace)::OpaqueType<4u>, unsigned int, 128, 1>, "
    "at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)":
        "copy / layout",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<"
    "at::native::index_kernel_impl<at::native::OpaqueType<4> >(at::TensorIteratorBase&, "
    "c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1}>"
    "(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>, at::native::"
    "index_kernel_impl<at::native::OpaqueType<4> >(at::TensorIteratorBase&, "
    "c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1} const&, "
    "bool)::{lambda(int)#1}>(long, at::native::gpu_index_kernel<...>)": "copy / layout",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
    "func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()("
    "at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >("
    "at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<"
    "float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
    "unsigned int, float, 4, 4>)": "reduction",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
    "NormTwoOps<float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<"
    "float, at::native::NormTwoOps<float, float, float>, unsigned int, float, 4, 4>)":
        "reduction",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, "
    "int)": "softmax",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, "
    "float, long>(float*, float*, float const*, long const*, float const*, bool, long, long, "
    "long, long)": "loss",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, "
    "float, float const*, float const*, float const*, float*, float*, float*)": "norm",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel_32x32<float, float>"
    "(long, long, float const*, float const*, float const*, float const*, float*, float*)":
        "norm",
    "void at::native::batch_norm_collect_statistics_channels_last_kernel<at::native::Var, "
    "float, float, 4>(float const*, int, int, float, volatile float*, float*, float*, int*, "
    "bool)": "norm",
    "void at::native::(anonymous namespace)::max_pool_backward_nchw<float, float>(float "
    "const*, long const*, int, long, long, long, long, long, int, int, int, int, int, int, "
    "int, int, int, int, float*)": "pool / resize",
    "void at::native::(anonymous namespace)::upsample_nearest2d_out_frame<float, "
    "at::native::nearest_idx>(float const*, float*, unsigned long, unsigned long, "
    "unsigned long, unsigned long, unsigned long, float, float)": "pool / resize",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
    "(anonymous namespace)::TensorListMetadata<3>, at::native::(anonymous namespace)::"
    "FusedSgdMathFunctor<float, 3>, double, double, double, bool, bool, bool, float*, "
    "float*, float const*>(at::native::(anonymous namespace)::TensorListMetadata<3>, ...)":
        "optimizer",
    "void at::native::(anonymous namespace)::indexing_backward_kernel<float, 4>(long const*, "
    "long const*, float const*, float*, long, long, long, long, bool)": "copy / layout",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
    "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >,"
    " false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)":
        "attention",
    "void pytorch_flash::flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8,"
    " 4, 2, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, "
    "cutlass::bfloat16_t> > >(pytorch_flash::Flash_bwd_params)": "attention",
    "fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, "
    "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)": "attention",
    "void at::native::(anonymous namespace)::fused_dropout_kernel_vec<float, float, "
    "unsigned int, 1, 4, bool>(at::cuda::detail::TensorInfo<float const, unsigned int>, "
    "at::cuda::detail::TensorInfo<float, unsigned int>, at::cuda::detail::TensorInfo<bool, "
    "unsigned int>, unsigned int, float, at::PhiloxCudaState)": "pointwise",
    # inductor (torch.compile)
    "triton_tem_fused_mm_0": "gemm",
    "triton_tem_fused_addmm_relu_3": "gemm",
    "triton_tem_fused_convolution_1": "conv fprop",
    "triton_tem_fused_flex_attention_0": "attention",
    "triton_poi_fused_convolution_relu_2": "pointwise",
    "triton_poi_fused_add_addmm_gelu_5": "pointwise",
    "triton_red_fused_convolution_backward_4": "reduction",
    "triton_per_fused_sum_7": "reduction",
    "triton_red_fused__native_batch_norm_legit_functional_6": "norm",
    "triton_per_fused_native_layer_norm_native_layer_norm_backward_9": "norm",
    "triton_per_fused__log_softmax_nll_loss_forward_10": "softmax",
    "triton_red_fused_nll_loss_backward_11": "loss",
    "triton_poi_fused_max_pool2d_with_indices_12": "pool / resize",
    "triton_poi_fused_cat_13": "copy / layout",
    "triton_poi_fused__to_copy_14": "copy / layout",
    "triton_poi_fused_clone_permute_15": "copy / layout",
    "triton_poi_fused__to_copy_add_16": "pointwise",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_family_of_a_representative_kernel_name(name):
    assert kt.family(name) == NAMES[name]


def test_every_family_is_reached_by_some_name():
    assert set(NAMES.values()) == set(kt.FAMILIES)


def test_the_parameter_list_is_left_out_of_the_match():
    assert kt.without_arguments("void f<int, g(int)>(IndexType, float*)") == \
        "void f<int, g(int)>"
    assert kt.without_arguments("void at::native::(anonymous namespace)::k<float>") == \
        "void at::native::(anonymous namespace)::k<float>"
    # an argument type that names a family does not decide it
    assert kt.family("void my_thing_kernel(at::native::IndexToOffset, float*)") == "other"


EVENTS = [  # three steps of a synthetic trace
    *[("tile_matmul_kernel", 40.0)] * 6,                  # 2 calls a step, 80 µs a step
    *[("pointwise_kernel", 5.0)] * 12,                    # 4 calls, 20 µs
    ("sgd_update_kernel", 9.0), ("sgd_update_kernel", 9.0), ("sgd_update_kernel", 12.0),
    ("conv2d_tiled_kernel<float>", 45.0), ("conv2d_tiled_kernel<float>", 45.0),
    ("conv2d_tiled_kernel<float>", 60.0),                 # 1 call, 50 µs
    ("guard_check_kernel", 3.0),                           # 1 call in 3 steps
]


def test_the_summary_divides_by_the_steps_and_orders_by_cost():
    trace = kt.summarize(EVENTS, steps=3)
    assert trace.steps == 3
    assert [k.name for k in trace.kernels] == ["tile_matmul_kernel",
                                               "conv2d_tiled_kernel<float>",
                                               "pointwise_kernel", "sgd_update_kernel",
                                               "guard_check_kernel"]
    by_name = {k.name: k for k in trace.kernels}
    assert by_name["tile_matmul_kernel"].us_per_step == pytest.approx(80.0)
    assert by_name["tile_matmul_kernel"].calls_per_step == pytest.approx(2.0)
    assert by_name["pointwise_kernel"].calls_per_step == pytest.approx(4.0)
    assert by_name["sgd_update_kernel"].us_per_step == pytest.approx(10.0)
    assert by_name["guard_check_kernel"].calls_per_step == pytest.approx(1 / 3)
    assert trace.total_us == pytest.approx(sum(us for _, us in EVENTS) / 3)
    assert trace.launches_per_step == pytest.approx(len(EVENTS) / 3)
    assert list(trace.families) == ["gemm", "conv fprop", "pointwise", "optimizer", "other"]
    assert trace.families["gemm"] == pytest.approx(80.0)
    assert trace.families["other"] == pytest.approx(1.0)
    assert sum(trace.families.values()) == pytest.approx(trace.total_us)


def test_the_json_keeps_the_top_kernels_in_cost_order():
    trace = kt.summarize(EVENTS, steps=3)
    out = trace.as_json(top=2)
    assert list(out["kernels"]) == ["tile_matmul_kernel", "conv2d_tiled_kernel<float>"]
    assert out["kernels"]["tile_matmul_kernel"] == {"us_per_step": pytest.approx(80.0),
                                                    "calls": pytest.approx(2.0),
                                                    "family": "gemm"}
    assert len(trace.as_json()["kernels"]) == 5
    assert out["total_us"] == pytest.approx(trace.total_us)
    with pytest.raises(ValueError):
        kt.summarize(EVENTS, steps=0)


def test_the_report_lists_families_and_the_costliest_kernels():
    text = kt.report("stepgraph", kt.summarize(EVENTS, steps=3), top=1)
    assert text.splitlines()[0] == \
        "== stepgraph: 161.0 µs of kernels a step, 8 launches a step"
    assert "tile_matmul_kernel" in text and "conv2d_tiled_kernel" not in text
    assert any(line.split()[:2] == ["gemm", "80.0"] for line in text.splitlines())


def test_the_comparison_has_families_as_rows_and_systems_as_columns():
    ours = kt.summarize(EVENTS, steps=3).as_json(top=3)
    theirs = kt.summarize([("ampere_sgemm_128x64_tn", 100.0)] * 3
                          + [("triton_poi_fused_relu_0", 10.0)] * 3, steps=3).as_json()
    lines = kt.comparison({"stepgraph": ours, "torch eager": None,
                           "torch graph": {"error": "RuntimeError: boom"},
                           "torch compile": theirs}).splitlines()
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines]
    assert cells[0] == ["µs a step", "stepgraph", "torch eager", "torch graph", "torch compile"]
    rows = {row[0]: row[1:] for row in cells[1:]}
    # families by their largest cost over the systems, then the total and the launches
    assert list(rows) == ["gemm", "conv fprop", "pointwise", "optimizer", "other", "total",
                          "launches"]
    assert rows["gemm"] == ["80.0", "-", "failed", "100.0"]
    assert rows["conv fprop"] == ["50.0", "-", "failed", "0.0"]
    assert rows["pointwise"] == ["20.0", "-", "failed", "10.0"]
    assert rows["total"] == ["161.0", "-", "failed", "110.0"]
    assert rows["launches"] == ["8", "-", "failed", "2"]


def test_kernel_trace_cli_still_parses():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-trace"), "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    for flag in ("--workload", "--precision", "--peers", "--steps", "--top", "--json"):
        assert flag in run.stdout
