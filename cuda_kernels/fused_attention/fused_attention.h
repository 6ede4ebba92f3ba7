/* C interface of the CUDA fused attention (libmxfusion_cuda.so).
 *
 * out = softmax(scale * q k^T + mask) v for every (b, h).  Any of the op's layouts is
 * described by strides: row r of head (b, h) of X starts at X + b*x_bs + h*x_hs + r*x_rs
 * (elements).  All pointers are device pointers; float32.  Returns 0 or a cudaError_t.
 * Semantics match the CPU op: rows with no visible key (valid length 0, empty causal band)
 * give 0; rows whose scores are all -inf, or hold a NaN or +inf, give NaN; a row that skips
 * keys gives NaN in the columns where v is not finite among them (as 0 * v does).
 *
 * causal: 0 none; keys j > i + (Sk - Sq) after row i's band are
 *   1 (MXF_CAUSAL_EXCLUDE) dropped, 2 (MXF_CAUSAL_ADD) given score + mask_value,
 *   3 (MXF_CAUSAL_FILL) given the score mask_value (2 and 3 take mask_kind NONE).
 */
#ifndef MXF_FUSED_ATTENTION_H_
#define MXF_FUSED_ATTENTION_H_
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

enum { MXF_MASK_NONE = 0, MXF_MASK_ADDITIVE = 1, MXF_MASK_BOOLEAN = 2, MXF_MASK_VALID_LENGTH = 3 };
enum { MXF_CAUSAL_NONE = 0, MXF_CAUSAL_EXCLUDE = 1, MXF_CAUSAL_ADD = 2, MXF_CAUSAL_FILL = 3 };

typedef struct {
  int64_t B, H, Sq, Sk, D, Dv;
  const float *q, *k, *v;
  float* o;
  int64_t q_bs, q_hs, q_rs, k_bs, k_hs, k_rs, v_bs, v_hs, v_rs, o_bs, o_hs, o_rs;
  int32_t mask_kind;
  const float* mask;              /* additive / boolean: element (b,h,i,j) at          */
  int64_t m_sb, m_sh, m_sq, m_sk; /* mask + b*m_sb + h*m_sh + i*m_sq + j*m_sk (0=bcast) */
  const int32_t* lengths;         /* valid_length: lengths[(b*H+h)*len_sn + i*len_sq]  */
  int64_t len_sn, len_sq;
  float scale, mask_value;        /* mask_value: boolean fill, or the causal add / fill value */
  int32_t causal;                 /* MXF_CAUSAL_*: what happens to keys after the band */
} mxf_attention_args;

/* Supports D, Dv <= 256. stream: cudaStream_t (0 = default stream). */
int mxf_attention_forward(const mxf_attention_args* args, void* stream);

#ifdef __cplusplus
}
#endif
#endif
