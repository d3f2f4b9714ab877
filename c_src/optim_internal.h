/* optim_internal.h - not part of the public API: the split validate / apply
 * entry points the worker pool uses (validate every chunk of a batch first,
 * then apply, so a malformed list changes nothing). */
#ifndef STELLA_OPTIM_INTERNAL_H
#define STELLA_OPTIM_INTERNAL_H
#include "stella_optim.h"

/* Entries idx[lo..hi): strictly ascending, each in [cmin, cmax) (cmax <= n),
 * and for EXACT 0 <= last[idx] < step. Also checks idx[lo-1] < idx[lo] when
 * lo > 0 and check_prev is set. Read-only. */
int stella_optim_validate_entries(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                                  const uint32_t *idx, int64_t lo, int64_t hi, int64_t step,
                                  int64_t cmin, int64_t cmax);

/* stella_optim_apply without the argument and entry checks (the caller did them). */
void stella_optim_apply_unchecked(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                                  const uint32_t *idx, const float *val, int64_t lo, int64_t hi,
                                  int64_t step);

#endif
