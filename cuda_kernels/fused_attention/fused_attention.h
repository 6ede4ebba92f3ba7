/* C interface of the CUDA fused attention (libmxfusion_cuda.so); conventions (dtype, stream,
 * workspace, req, return codes) in common/mxf_cuda_types.h.
 *
 * out = softmax(scale * q k^T + mask) v for every (b, h).  Any of the op's layouts is
 * described by strides: row r of head (b, h) of X starts at X + b*x_bs + h*x_hs + r*x_rs
 * (elements; the last dim is contiguous).  q, k, v, o, an additive / boolean mask and every
 * gradient have `dtype`; lengths are int32; lse is float32.  D, Dv <= 256.
 * Semantics match the CPU op: rows with no visible key (valid length 0, empty causal band)
 * give 0; rows whose scores are all -inf, or hold a NaN or +inf, give NaN; a row that skips
 * keys gives NaN in the columns where v is not finite among them (as 0 * v does).
 *
 * causal: 0 none; keys j > i + (Sk - Sq) after row i's band are
 *   1 (MXF_CAUSAL_EXCLUDE) dropped, 2 (MXF_CAUSAL_ADD) given score + mask_value,
 *   3 (MXF_CAUSAL_FILL) given the score mask_value (2 and 3 take mask_kind NONE).
 *
 * Backends (attention_dispatch.cu; mxf_attention_backend() says which one a call takes and why):
 * fp16 / bf16 on cuDNN's fused flash attention where it computes these semantics exactly (libcudnn
 * opened at the first call; see attention_cudnn.cu), else on the own kernels; fp32 on cuBLASLt
 * products around a masked softmax (TF32 only with allow_tf32).  The own forward: flash-style,
 * tiled over keys with an online softmax, O(S*d) memory; fp16 / bf16 on tensor cores (mma.sync
 * m16n8k16, fp32 accumulation), fp32 with fp32 FMAs; key tiles after every row's band (causal
 * exclude, valid lengths) are never read.  Not yet run on a GPU.  lse (may be NULL) receives
 * the log-sum-exp of each row's scores, lse[(b*H + h)*Sq + i] (natural log, of the scaled and
 * masked scores); +inf for a row with no visible key, NaN for a NaN row.
 *
 * Backward: flash-style with recomputation from lse (which the backward requires): dq, dk, dv
 * (sharing q / k / v's strides) and, for an additive mask that needs a gradient, dmask with the
 * mask's own strides (m_s*: 0 where the mask broadcasts, the gradient summed there; dmask_numel
 * elements).  req_* as mxf_cuda_types.h.  Keys a causal add / fill mode leaves to the row get
 * their gradient (the forward's exact skipping of negligible keys does not change it).
 */
#ifndef MXF_FUSED_ATTENTION_H_
#define MXF_FUSED_ATTENTION_H_
#include <stddef.h>
#include <stdint.h>

#include "mxf_cuda_types.h"
#ifdef __cplusplus
extern "C" {
#endif

enum { MXF_MASK_NONE = 0, MXF_MASK_ADDITIVE = 1, MXF_MASK_BOOLEAN = 2, MXF_MASK_VALID_LENGTH = 3 };
enum { MXF_CAUSAL_NONE = 0, MXF_CAUSAL_EXCLUDE = 1, MXF_CAUSAL_ADD = 2, MXF_CAUSAL_FILL = 3 };
/* Backends: the project's own kernels; cuDNN's fused flash attention (fp16 / bf16, through the cuDNN
 * frontend's graph API, libcudnn loaded at the first call); for fp32, cuBLASLt batched products around
 * a masked-softmax kernel with the S x S scores in the workspace. */
enum { MXF_ATTN_AUTO = 0, MXF_ATTN_OWN = 1, MXF_ATTN_CUDNN = 2, MXF_ATTN_GEMM = 3 };
/* lengths_hint bits: every row of batch element b has the length of row 0 of head (b, 0)
 * (MXF_LEN_PER_BATCH), and every length, clamped to [0, Sk], is at least 1 (MXF_LEN_NONZERO). */
enum { MXF_LEN_PER_BATCH = 1, MXF_LEN_NONZERO = 2 };

typedef struct {
  int32_t dtype;                  /* MXF_F32 / MXF_F16 / MXF_BF16 */
  int64_t B, H, Sq, Sk, D, Dv;
  const void *q, *k, *v;
  void* o;
  int64_t q_bs, q_hs, q_rs, k_bs, k_hs, k_rs, v_bs, v_hs, v_rs, o_bs, o_hs, o_rs;
  int32_t mask_kind;
  const void* mask;               /* additive / boolean: element (b,h,i,j) at          */
  int64_t m_sb, m_sh, m_sq, m_sk; /* mask + b*m_sb + h*m_sh + i*m_sq + j*m_sk (0=bcast) */
  const int32_t* lengths;         /* valid_length: lengths[(b*H+h)*len_sn + i*len_sq]  */
  int64_t len_sn, len_sq;
  float scale, mask_value;        /* mask_value: boolean fill, or the causal add / fill value */
  int32_t causal;                 /* MXF_CAUSAL_*: what happens to keys after the band */
  float* lse;                     /* forward: output, or NULL; backward: input (required) */
  /* Appended fields; zero (a zero-initialised struct) keeps the defaults. */
  int32_t backend;                /* MXF_ATTN_*: AUTO chooses by the capability check; another forces
                                     that backend (MXF_ERR_UNSUPPORTED where it cannot run the call) */
  int32_t allow_tf32;             /* fp32 products on TF32 tensor cores (the op's precision="tf32") */
  int32_t lengths_hint;           /* MXF_LEN_* facts about `lengths` the caller checked on the host */
} mxf_attention_args;

typedef struct {
  const void* dout;               /* dO, with o's strides (o_bs, o_hs, o_rs) */
  void *dq, *dk, *dv;             /* q's / k's / v's strides */
  void* dmask;                    /* additive mask gradient, the mask's strides, or NULL */
  int64_t dmask_numel;            /* elements of the mask tensor (dmask) */
  int32_t req_dq, req_dk, req_dv, req_dmask;
} mxf_attention_grads;

/* The backend a call with these arguments runs (MXF_ATTN_OWN / CUDNN / GEMM) for the forward
 * (backward = 0) or the backward (1), or a negative MXF_ERR_* code for arguments no backend takes.
 * `why` (may be NULL) receives, NUL-terminated, why the faster backends were not chosen (empty when
 * the first choice runs), e.g. "cudnn: boolean mask (a fully masked row averages v, cuDNN cannot
 * express the fill value)".  Callable without a GPU: the semantic checks need no device; cuDNN's
 * own support check (its graph build) needs one and says so.  The environment variable
 * MXFUSION_ATTN_BACKEND=own|cudnn|gemm overrides AUTO (for bisecting). */
int mxf_attention_backend(const mxf_attention_args* args, int backward, char* why, size_t why_size);

size_t mxf_attention_forward_workspace_size(const mxf_attention_args* args);
int mxf_attention_forward(const mxf_attention_args* args, void* workspace, size_t workspace_size,
                          void* stream);

/* args: as the forward, with o the forward's output and lse its log-sum-exp. */
size_t mxf_attention_backward_workspace_size(const mxf_attention_args* args,
                                             const mxf_attention_grads* grads);
int mxf_attention_backward(const mxf_attention_args* args, const mxf_attention_grads* grads,
                           void* workspace, size_t workspace_size, void* stream);

#ifdef __cplusplus
}
#endif
#endif
