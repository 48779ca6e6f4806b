/* Dispatch, every part: the umbrella of the codec (kvasir/dispatch_proto.h),
 * signed results (kvasir/dispatch_evidence.h), the worker
 * (kvasir/dispatch_worker.h), the remote provider (kvasir/dispatch_remote.h)
 * and work receipts (kvasir/dispatch_receipt.h). Include the part you use;
 * this header is for code that drives all of them (the gateway). */
#ifndef KVASIR_DISPATCH_H
#define KVASIR_DISPATCH_H

#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_receipt.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/dispatch_worker.h"

#endif
