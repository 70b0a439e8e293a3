/*
 * _vcore: the verbs transport's posts and polls in C (dpu_wire/transport/native.py).
 *
 * pyverbs stays the resource layer: it makes the context, PD, CQs, QP and MRs. This
 * module takes the raw `struct ibv_qp *` and `struct ibv_cq_ex *` of those objects
 * (found and checked by native.py) and does only the per-operation calls, the ones a
 * job makes: ibv_post_send (one WR, or a WRITE chained to a SEND), ibv_post_recv of a
 * RECV ring slot, and one completion at a time from an extended CQ. Under pyverbs each
 * post rewrote Python-level SGE and SendWR attributes and each completion took three
 * calls; here each is one call taking and returning plain integers.
 *
 * Every function is a static inline of <infiniband/verbs.h>: a call through the
 * provider's function pointers, the verbs ABI. Nothing is linked but libc.
 *
 * rxe and extended CQs: one start_poll/end_poll pair per completion. rxe's next_poll
 * ends the batch by itself when the queue is empty, and an end_poll after that skips a
 * slot for ever (the soft-RoCE notes); so this module never calls next_poll.
 *
 * The agent's fast path (serve, poll_send) runs COPY jobs the pipeline would run the
 * same way: an inline one to its end at once; one it READs from the host in two steps,
 * the READ posted when the SUBMIT is taken and the WRITE and COMPLETION when poll_send
 * takes the READ's completion. Python holds the second kind open meanwhile (CANCEL,
 * deadlines, ids in use are the pipeline's), and tells the core when it ends one
 * (core_cancel).
 *
 * The spin waits release the GIL, so other threads (gRPC, the storage workers) run
 * while a side waits for its peer; posts keep it (see do_post). Not thread-safe: one
 * owner thread calls a Qp, as with the pyverbs objects it replaces.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <sched.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* A host region of the session: [addr, last], rkey, and what it grants the agent. */
#define REGION_READ 1u  /* REMOTE_READ: a job may READ its source here */
#define REGION_WRITE 2u /* REMOTE_WRITE: a job may WRITE its output here */
typedef struct {
    uint64_t addr;
    uint64_t last;
    uint32_t rkey;
    uint32_t access;
} FastRegion;

/* A READ-path COPY the core runs (serve, poll_send), one per READ ring slot: READING
 * while its READ is out, DROPPED once the pipeline ended it while the READ was out (the
 * slot stays taken until the READ completed, DP-2.6-5), SENDING once its WRITE and
 * COMPLETION are posted (the slot is free again when the SEND completed). */
enum { CORE_FREE, CORE_READING, CORE_DROPPED, CORE_SENDING };
typedef struct {
    uint64_t job_id;
    uint64_t dst;
    uint64_t submit_ns;   /* CLOCK_REALTIME, as the COMPLETION carries them */
    uint64_t start_ns;
    uint64_t deadline_ns; /* CLOCK_MONOTONIC */
    uint32_t length;
    uint32_t dst_rkey;
    int state;
} CoreJob;

/* The wr_ids of the core's READ-path jobs: CORE_WR | slot << 2 | op. The pipeline's
 * wr_ids count up from 1 and never reach bit 62. */
#define CORE_WR (UINT64_C(1) << 62)
enum { CORE_OP_READ = 0, CORE_OP_WRITE = 1, CORE_OP_SEND = 2 };
#define CORE_DATA 128 /* a READ slot: the job's COMPLETION, then its data from here */
#define CORE_WRS 2    /* send-queue entries a READ-path job holds: READ, then WRITE + SEND */

typedef struct {
    PyObject_HEAD
    struct ibv_qp *qp;
    struct ibv_cq_ex *send_cq;
    struct ibv_cq_ex *recv_cq;
    uint64_t recv_addr;  /* the RECV ring: recv_depth slots of recv_slot bytes */
    uint32_t recv_slot;
    uint32_t recv_depth;
    uint32_t recv_lkey;
    int live;            /* 0 once close() ran: the resources are pyverbs', gone after */
    /* The agent's fast path (serve): its ring of slots, each a COMPLETION then the
     * job's data, used in order and freed in order as their SENDs complete. */
    uint64_t fast_addr;
    uint32_t fast_lkey;
    uint32_t fast_slot;
    uint32_t fast_slots;
    uint32_t inline_max;
    uint64_t *fast_send_id;  /* per slot: the wr_id of its SEND while in flight */
    uint32_t fast_head;
    uint32_t fast_used;
    FastRegion *regions;
    Py_ssize_t n_regions;
    /* A receive completion wait_any() took and nobody has been given yet. */
    int stashed;
    uint64_t stash_wr_id;
    int stash_status;
    uint32_t stash_byte_len;
    /* The same for the send queue's completions. */
    int send_stashed;
    uint64_t send_stash_wr_id;
    int send_stash_status;
    /* call(): the errno of the last RECV repost it made (0: it succeeded). */
    int recv_errno;
    /* The READ path (read_setup): a ring of read_slots slots of read_slot bytes, a
     * CoreJob each; jobs of up to read_max bytes. */
    uint64_t read_addr;
    uint32_t read_lkey;
    uint32_t read_slot;
    uint32_t read_slots;
    uint32_t read_max;
    uint64_t default_deadline_ns;
    CoreJob *core;
    unsigned int core_busy; /* slots not FREE: each holds CORE_WRS send-queue entries */
    PyObject *core_done;    /* [(job_id, end_ns, late)]: COMPLETIONs posted, for take_done() */
} Qp;

static int qp_live(Qp *self)
{
    if (!self->live) {
        PyErr_SetString(PyExc_ValueError, "the native queue pair is closed");
        return 0;
    }
    return 1;
}

static int Qp_init(Qp *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"qp", "qp_num", "send_cq", "recv_cq", "recv_addr",
                             "recv_slot", "recv_depth", "recv_lkey", NULL};
    unsigned long long qp, send_cq, recv_cq, recv_addr;
    unsigned int qp_num, recv_slot, recv_depth, recv_lkey;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KIKKKIII", kwlist, &qp, &qp_num, &send_cq,
                                     &recv_cq, &recv_addr, &recv_slot, &recv_depth, &recv_lkey))
        return -1;
    if (!qp || !send_cq || !recv_cq || !recv_addr || !recv_slot || !recv_depth) {
        PyErr_SetString(PyExc_ValueError, "null pointer or empty ring");
        return -1;
    }
    struct ibv_qp *q = (struct ibv_qp *)(uintptr_t)qp;
    /* The pointers were located in pyverbs objects' memory: check they belong together
     * before anything is posted through them. ibv_cq_ex_to_cq() is a cast. */
    if (q->qp_num != qp_num || q->send_cq != (struct ibv_cq *)(uintptr_t)send_cq ||
        q->recv_cq != (struct ibv_cq *)(uintptr_t)recv_cq || !q->context ||
        ((struct ibv_cq *)(uintptr_t)send_cq)->context != q->context) {
        PyErr_SetString(PyExc_ValueError, "the QP and CQ pointers do not belong together");
        return -1;
    }
    self->qp = q;
    self->send_cq = (struct ibv_cq_ex *)(uintptr_t)send_cq;
    self->recv_cq = (struct ibv_cq_ex *)(uintptr_t)recv_cq;
    self->recv_addr = recv_addr;
    self->recv_slot = recv_slot;
    self->recv_depth = recv_depth;
    self->recv_lkey = recv_lkey;
    self->live = 1;
    return 0;
}

static int parse_u64(PyObject *o, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *out = v;
    return 1;
}

static int parse_u32(PyObject *o, uint32_t *out)
{
    unsigned long v = PyLong_AsUnsignedLong(o);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return 0;
    if (v > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "value does not fit 32 bits");
        return 0;
    }
    *out = (uint32_t)v;
    return 1;
}

static PyObject *post_result(int rc)
{
    return PyLong_FromLong(rc);
}

/* The GIL stays held, as pyverbs holds it: on hardware a post is a doorbell write of a
 * few hundred nanoseconds, and on rxe, where it is a system call that does the soft
 * NIC's work, releasing it let the agent's other threads take the GIL and the reactor
 * wait for it back after every post (copy jobs 64 KiB x16 lost 15-20 %). */
static int do_post(Qp *self, struct ibv_send_wr *wr)
{
    struct ibv_send_wr *bad = NULL;
    return ibv_post_send(self->qp, wr, &bad);
}

/* do_post, also saying whether the chain's first request went out when a later one was
 * refused (*partly: the device has it and may still read its buffer). */
static int do_post_chain(Qp *self, struct ibv_send_wr *wr, int *partly)
{
    struct ibv_send_wr *bad = NULL;
    int err = ibv_post_send(self->qp, wr, &bad);
    *partly = err && bad && bad != wr;
    return err;
}

/* send_copy's work, for it and call(): the errno of the post, or -1 with an exception
 * (nothing posted). args: wr_id, addr, room, lkey, head, tail. */
static int copy_and_send(Qp *self, PyObject *const *args)
{
    uint64_t wr_id, addr;
    uint32_t room, lkey;
    if (!qp_live(self) || !parse_u64(args[0], &wr_id) || !parse_u64(args[1], &addr) ||
        !parse_u32(args[2], &room) || !parse_u32(args[3], &lkey))
        return -1;
    Py_buffer head, tail = {0};
    if (PyObject_GetBuffer(args[4], &head, PyBUF_SIMPLE) < 0)
        return -1;
    if (args[5] != Py_None && PyObject_GetBuffer(args[5], &tail, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&head);
        return -1;
    }
    size_t total = (size_t)head.len + (size_t)tail.len;
    if (total > room) {
        PyBuffer_Release(&head);
        if (tail.obj)
            PyBuffer_Release(&tail);
        PyErr_SetString(PyExc_ValueError, "the capsule exceeds its send slot");
        return -1;
    }
    uint8_t *slot = (uint8_t *)(uintptr_t)addr;
    memcpy(slot, head.buf, (size_t)head.len);
    if (tail.obj)
        memcpy(slot + head.len, tail.buf, (size_t)tail.len);
    PyBuffer_Release(&head);
    if (tail.obj)
        PyBuffer_Release(&tail);
    struct ibv_sge sge = {.addr = addr, .length = (uint32_t)total, .lkey = lkey};
    struct ibv_send_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
                             .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
    return do_post(self, &wr);
}

/* send_copy(wr_id, addr, room, lkey, head, tail) -> errno: copy `head` then `tail`
 * (bytes-like; tail may be None) to `addr`, a send slot of `room` bytes, and post a
 * signalled SEND of them. */
static PyObject *Qp_send_copy(Qp *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "send_copy(wr_id, addr, room, lkey, head, tail)");
        return NULL;
    }
    int rc = copy_and_send(self, args);
    return rc < 0 ? NULL : post_result(rc);
}

/* post_rdma(wr_id, read, addr, length, lkey, remote_addr, rkey, signaled) -> errno. */
static PyObject *Qp_post_rdma(Qp *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t wr_id, addr, raddr;
    uint32_t length, lkey, rkey;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "post_rdma(wr_id, read, addr, length, lkey, remote_addr, rkey, signaled)");
        return NULL;
    }
    if (!qp_live(self) || !parse_u64(args[0], &wr_id) || !parse_u64(args[2], &addr) ||
        !parse_u32(args[3], &length) || !parse_u32(args[4], &lkey) ||
        !parse_u64(args[5], &raddr) || !parse_u32(args[6], &rkey))
        return NULL;
    int read = PyObject_IsTrue(args[1]);
    int signaled = PyObject_IsTrue(args[7]);
    if (read < 0 || signaled < 0)
        return NULL;
    struct ibv_sge sge = {.addr = addr, .length = length, .lkey = lkey};
    struct ibv_send_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
                             .opcode = read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE,
                             .send_flags = signaled ? IBV_SEND_SIGNALED : 0};
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    return post_result(do_post(self, &wr));
}

/* post_chain(write_id, addr, length, lkey, remote_addr, rkey, send_id, send_addr,
 * send_length, send_lkey) -> errno: an unsignalled WRITE and a signalled SEND right
 * behind it, one ibv_post_send (one doorbell). */
static PyObject *Qp_post_chain(Qp *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t write_id, addr, raddr, send_id, send_addr;
    uint32_t length, lkey, rkey, send_length, send_lkey;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "post_chain takes 10 arguments");
        return NULL;
    }
    if (!qp_live(self) || !parse_u64(args[0], &write_id) || !parse_u64(args[1], &addr) ||
        !parse_u32(args[2], &length) || !parse_u32(args[3], &lkey) ||
        !parse_u64(args[4], &raddr) || !parse_u32(args[5], &rkey) ||
        !parse_u64(args[6], &send_id) || !parse_u64(args[7], &send_addr) ||
        !parse_u32(args[8], &send_length) || !parse_u32(args[9], &send_lkey))
        return NULL;
    struct ibv_sge sges[2] = {{.addr = addr, .length = length, .lkey = lkey},
                              {.addr = send_addr, .length = send_length, .lkey = send_lkey}};
    struct ibv_send_wr send = {.wr_id = send_id, .sg_list = &sges[1], .num_sge = 1,
                               .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
    struct ibv_send_wr write = {.wr_id = write_id, .next = &send, .sg_list = &sges[0],
                                .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE, .send_flags = 0};
    write.wr.rdma.remote_addr = raddr;
    write.wr.rdma.rkey = rkey;
    return post_result(do_post(self, &write));
}

/* Repost RECV ring slot `slot` (its wr_id is the slot, < recv_depth): the errno. */
static int repost(Qp *self, uint64_t slot)
{
    struct ibv_sge sge = {.addr = self->recv_addr + slot * self->recv_slot,
                          .length = self->recv_slot, .lkey = self->recv_lkey};
    struct ibv_recv_wr wr = {.wr_id = slot, .sg_list = &sge, .num_sge = 1};
    struct ibv_recv_wr *bad = NULL;
    return ibv_post_recv(self->qp, &wr, &bad);
}

/* post_recv(slot) -> errno: repost RECV ring slot `slot` (its wr_id is the slot). */
static PyObject *Qp_post_recv(Qp *self, PyObject *arg)
{
    if (!qp_live(self))
        return NULL;
    unsigned long slot = PyLong_AsUnsignedLong(arg);
    if (slot == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (slot >= self->recv_depth) {
        PyErr_SetString(PyExc_ValueError, "no such RECV slot");
        return NULL;
    }
    return post_result(repost(self, slot));
}

/* One completion of an extended CQ: 1 and its fields, 0 if empty, -errno on error. */
static int take_one(struct ibv_cq_ex *cq, uint64_t *wr_id, int *status, uint32_t *byte_len)
{
    struct ibv_poll_cq_attr attr = {0};
    int rc = ibv_start_poll(cq, &attr);
    if (rc == ENOENT)
        return 0;
    if (rc)
        return -rc;
    *wr_id = cq->wr_id;
    *status = (int)cq->status;
    if (byte_len)
        *byte_len = *status == IBV_WC_SUCCESS ? ibv_wc_read_byte_len(cq) : 0;
    ibv_end_poll(cq);
    return 1;
}

/* The next receive completion: the one wait_recv() stashed, else the CQ's. */
static int take_recv(Qp *self, uint64_t *wr_id, int *status, uint32_t *byte_len)
{
    if (self->stashed) {
        self->stashed = 0;
        *wr_id = self->stash_wr_id;
        *status = self->stash_status;
        *byte_len = self->stash_byte_len;
        return 1;
    }
    return take_one(self->recv_cq, wr_id, status, byte_len);
}

static PyObject *poll_error(int rc)
{
    errno = -rc;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static int core_completion(Qp *self, uint64_t wr_id);

/* poll_send() -> (wr_id, status) or None: the next send-queue completion of the
 * pipeline's. The READ path's own (CORE_WR) are handled here (core_completion), up to 64
 * of them per call, and reported only when they failed: status, or minus the errno of a
 * post that failed. */
static PyObject *Qp_poll_send(Qp *self, PyObject *unused)
{
    if (!qp_live(self))
        return NULL;
    for (int turn = 0; turn < 64; turn++) {
        uint64_t wr_id = 0;
        int status = 0;
        int rc = 1;
        if (self->send_stashed) {
            self->send_stashed = 0;
            wr_id = self->send_stash_wr_id;
            status = self->send_stash_status;
        } else {
            rc = take_one(self->send_cq, &wr_id, &status, NULL);
        }
        if (rc == 0)
            Py_RETURN_NONE;
        if (rc < 0)
            return poll_error(rc);
        if (wr_id & CORE_WR) {
            if (status == IBV_WC_SUCCESS) {
                int err = core_completion(self, wr_id);
                if (err < 0)
                    return NULL;
                if (!err)
                    continue;
                status = -err;
            }
            return Py_BuildValue("(Ki)", (unsigned long long)wr_id, status);
        }
        /* RC completes the send queue in order: every fast slot whose SEND is at or
         * before this completion is free again. */
        while (self->fast_used && self->fast_send_id[self->fast_head] <= wr_id) {
            self->fast_head = (self->fast_head + 1) % self->fast_slots;
            self->fast_used--;
        }
        return Py_BuildValue("(Ki)", (unsigned long long)wr_id, status);
    }
    Py_RETURN_NONE;
}

/* poll_recv() -> (slot, status, byte_len) or None. */
static PyObject *Qp_poll_recv(Qp *self, PyObject *unused)
{
    uint64_t wr_id = 0;
    int status = 0;
    uint32_t byte_len = 0;
    if (!qp_live(self))
        return NULL;
    int rc = take_recv(self, &wr_id, &status, &byte_len);
    if (rc == 0)
        Py_RETURN_NONE;
    if (rc < 0)
        return poll_error(rc);
    return Py_BuildValue("(KiI)", (unsigned long long)wr_id, status, byte_len);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Poll the receive CQ, and the send CQ too if `sends`, until one of them gives a
 * completion (1, *sent saying which) or `timeout` ns passed (0); -errno on an error.
 * Called with the GIL released; yields the CPU every 64 polls to its other work (the
 * softirqs doing rxe's, the peer process). */
static int spin(Qp *self, uint64_t timeout, int sends, uint64_t *wr_id, int *status,
                uint32_t *byte_len, int *sent)
{
    uint64_t end = now_ns() + timeout;
    unsigned int spins = 0;
    *sent = 0;
    for (;;) {
        int rc = take_one(self->recv_cq, wr_id, status, byte_len);
        if (rc)
            return rc;
        if (sends && (rc = take_one(self->send_cq, wr_id, status, NULL)) != 0) {
            *sent = 1;
            return rc;
        }
        if ((++spins & 63) == 0) {
            if (now_ns() >= end)
                return 0;
            sched_yield();
        }
    }
}

/* The next receive completion: the stashed one, else the CQ's within `timeout` ns,
 * polled with the GIL released (1, 0 if none came, -errno). */
static int wait_recv(Qp *self, uint64_t timeout, uint64_t *wr_id, int *status,
                     uint32_t *byte_len)
{
    if (self->stashed)
        return take_recv(self, wr_id, status, byte_len);
    int rc, sent;
    Py_BEGIN_ALLOW_THREADS
    rc = spin(self, timeout, 0, wr_id, status, byte_len, &sent);
    Py_END_ALLOW_THREADS
    return rc;
}

/* Keep a receive completion for the next take_recv (the Python path's, in order). */
static void stash_recv(Qp *self, uint64_t wr_id, int status, uint32_t byte_len)
{
    self->stashed = 1;
    self->stash_wr_id = wr_id;
    self->stash_status = status;
    self->stash_byte_len = byte_len;
}

/* spin_recv(timeout_ns) -> (slot, status, byte_len) or None: poll the receive CQ, the
 * GIL released, until a completion comes or `timeout_ns` passed. A host waiting for
 * the one COMPLETION it expects takes it the moment it lands, without a trip through
 * its event loop. */
static PyObject *Qp_spin_recv(Qp *self, PyObject *arg)
{
    uint64_t wr_id = 0;
    int status = 0;
    uint32_t byte_len = 0;
    int rc;
    if (!qp_live(self))
        return NULL;
    unsigned long long timeout = PyLong_AsUnsignedLongLong(arg);
    if (timeout == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    rc = wait_recv(self, timeout, &wr_id, &status, &byte_len);
    if (rc == 0)
        Py_RETURN_NONE;
    if (rc < 0)
        return poll_error(rc);
    return Py_BuildValue("(KiI)", (unsigned long long)wr_id, status, byte_len);
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define LITTLE_ENDIAN_HOST 1
#else
#define LITTLE_ENDIAN_HOST 0 /* the capsules are little-endian: call() hands them over */
#endif

static uint16_t le16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t le64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* The fields of a received COMPLETION of job `job_id`, as dpu_wire.capsule's
 * completion_fields gives them: (job_id, state, status, bytes_read, bytes_written,
 * result, submit_ns, start_ns, end_ns, message). NULL without an exception when the
 * capsule is anything else (another job's, malformed: the Python path decides). */
static PyObject *completion_of(const uint8_t *c, uint32_t n, uint64_t job_id)
{
    if (!LITTLE_ENDIAN_HOST || n < 80 || c[0] != 'D' || c[1] != 'C' || c[2] != 1 ||
        c[3] != 3 /* COMPLETION */ || le32(c + 4) != n || le64(c + 8) != job_id)
        return NULL;
    uint16_t msg_len = le16(c + 20);
    uint8_t state = c[18];
    if (msg_len > 176 || 80u + msg_len != n || state < 3 || state > 5)
        return NULL;
    PyObject *message = PyUnicode_DecodeUTF8((const char *)c + 80, msg_len, "replace");
    if (!message)
        return NULL;
    return Py_BuildValue("(KiiKKKKKKN)", (unsigned long long)job_id, (int)state,
                         (int)le16(c + 16), (unsigned long long)le64(c + 24),
                         (unsigned long long)le64(c + 32), (unsigned long long)le64(c + 40),
                         (unsigned long long)le64(c + 48), (unsigned long long)le64(c + 56),
                         (unsigned long long)le64(c + 64), message);
}

/* call(wr_id, addr, room, lkey, head, tail, job_id, timeout_ns) -> fields or None
 *
 * A host's job alone in flight, in one call: send_copy()'s SEND (OSError if the post
 * fails), then a spin on the receive CQ, the GIL released, for up to `timeout_ns`. If
 * what arrives is the COMPLETION of `job_id`, its fields come back (completion_of) and
 * its RECV is reposted (the errno of that repost in `recv_errno`). Otherwise None: the
 * SEND is out, and whatever arrived stays for the next poll_recv or spin_recv. */
static PyObject *Qp_call(Qp *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t job_id, timeout;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "call(wr_id, addr, room, lkey, head, tail, job_id, timeout_ns)");
        return NULL;
    }
    if (!parse_u64(args[6], &job_id) || !parse_u64(args[7], &timeout))
        return NULL;
    int rc = copy_and_send(self, args);
    if (rc < 0)
        return NULL;
    if (rc) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    uint64_t slot = 0;
    int status = 0;
    uint32_t n = 0;
    int got = wait_recv(self, timeout, &slot, &status, &n);
    if (got < 0)
        return poll_error(got);
    if (got == 0)
        Py_RETURN_NONE;
    PyObject *fields = NULL;
    if (status == IBV_WC_SUCCESS && slot < self->recv_depth && n <= self->recv_slot) {
        const uint8_t *c = (const uint8_t *)(uintptr_t)(self->recv_addr + slot * self->recv_slot);
        fields = completion_of(c, n, job_id);
        if (!fields && PyErr_Occurred())
            PyErr_Clear(); /* undecodable text: the Python path reports it */
    }
    if (!fields) { /* for the Python path, in order */
        stash_recv(self, slot, status, n);
        Py_RETURN_NONE;
    }
    self->recv_errno = repost(self, slot);
    return fields;
}

/* fast_setup(addr, lkey, slot_bytes, slots, inline_max): the ring serve() uses. */
static PyObject *Qp_fast_setup(Qp *self, PyObject *args)
{
    unsigned long long addr;
    unsigned int lkey, slot, slots, inline_max;
    if (!qp_live(self) || !PyArg_ParseTuple(args, "KIIII", &addr, &lkey, &slot, &slots,
                                            &inline_max))
        return NULL;
    if (self->fast_slots) {
        PyErr_SetString(PyExc_ValueError, "the fast ring is already set up");
        return NULL;
    }
    if (!addr || !slots || inline_max > slot || slot - inline_max < 80 ||
        inline_max > self->recv_slot || self->recv_slot - inline_max < 80) {
        PyErr_SetString(PyExc_ValueError, "fast ring geometry does not fit the capsules");
        return NULL;
    }
    self->fast_send_id = PyMem_Calloc(slots, sizeof(uint64_t));
    if (!self->fast_send_id)
        return PyErr_NoMemory();
    self->fast_addr = addr;
    self->fast_lkey = lkey;
    self->fast_slot = slot;
    self->fast_slots = slots;
    self->inline_max = inline_max;
    Py_RETURN_NONE;
}

/* set_regions([(addr, length, rkey, access), ...]): the session's regions, with what
 * each grants (REGION_READ | REGION_WRITE), replacing the last list. */
static PyObject *Qp_set_regions(Qp *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "set_regions takes a list of (addr, length, rkey, access)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    FastRegion *regions = n ? PyMem_Calloc((size_t)n, sizeof(FastRegion)) : NULL;
    if (n && !regions) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long addr, length;
        unsigned int rkey, access;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKII", &addr, &length, &rkey,
                              &access))
            goto fail;
        if (!length || addr + (length - 1) < addr) {
            PyErr_SetString(PyExc_ValueError, "a region is empty or wraps past 2**64");
            goto fail;
        }
        regions[i] = (FastRegion){.addr = addr, .last = addr + (length - 1), .rkey = rkey,
                                  .access = access};
    }
    Py_DECREF(seq);
    PyMem_Free(self->regions);
    self->regions = regions;
    self->n_regions = n;
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    PyMem_Free(regions);
    return NULL;
}

#define FAST_PATH LITTLE_ENDIAN_HOST /* else serve() hands everything over */

static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

static uint64_t realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The region `rkey` names if [addr, addr + length) lies in it and it grants `access`. */
static const FastRegion *find_region(Qp *self, uint32_t rkey, uint64_t addr, uint32_t length,
                                     uint32_t access)
{
    if (addr > UINT64_MAX - (length - 1))
        return NULL;
    for (Py_ssize_t i = 0; i < self->n_regions; i++) {
        const FastRegion *r = &self->regions[i];
        if (r->rkey == rkey)
            return (r->access & access) && addr >= r->addr && addr + (length - 1) <= r->last
                       ? r
                       : NULL;
    }
    return NULL;
}

/* Whether `job_id` is a READ-path job the pipeline holds open (its id is in use). */
static int core_has(Qp *self, uint64_t job_id)
{
    for (uint32_t i = 0; i < self->read_slots; i++)
        if (self->core[i].state == CORE_READING && self->core[i].job_id == job_id)
            return 1;
    return 0;
}

/* Whether a received SUBMIT of `n` bytes is an inline COPY the fast path runs: every
 * check of docs/data-plane.md 2.5 it would pass in the pipeline, passed here. Anything
 * else (another kind or flag, a field set, a region not found, a span outside it) is
 * the pipeline's to answer, with the exact status the spec gives. */
static const FastRegion *fast_copy(Qp *self, const uint8_t *c, uint32_t n)
{
    if (n < 80 || c[0] != 'D' || c[1] != 'C' || c[2] != 1 || c[3] != 1 || le32(c + 4) != n)
        return NULL;
    uint64_t job_id = le64(c + 8);
    uint32_t src_len = le32(c + 32);
    if (job_id >> 63 || le16(c + 16) != 1 /* COPY */ || le16(c + 18) != 2 /* INLINE */ ||
        le64(c + 24) != 0 || le32(c + 36) != 0 || src_len == 0 ||
        src_len > self->inline_max || n != 80 + src_len)
        return NULL;
    for (int i = 56; i < 80; i++) /* offset, handle, reserved, length: all 0 for COPY */
        if (c[i])
            return NULL;
    if (le32(c + 48) != src_len || core_has(self, job_id))
        return NULL;
    return find_region(self, le32(c + 52), le64(c + 40), src_len, REGION_WRITE);
}

/* Whether a received SUBMIT of `n` bytes is a COPY the READ path runs: as fast_copy
 * says for an inline one, with the source READ from a region that grants REMOTE_READ,
 * of at most read_max bytes. */
static int core_copy(Qp *self, const uint8_t *c, uint32_t n)
{
    if (!self->read_slots || n != 80 || c[0] != 'D' || c[1] != 'C' || c[2] != 1 || c[3] != 1 ||
        le32(c + 4) != 80)
        return 0;
    uint64_t job_id = le64(c + 8);
    uint32_t length = le32(c + 32);
    if (job_id >> 63 || le16(c + 16) != 1 /* COPY */ || le16(c + 18) != 0 /* no flag */ ||
        length == 0 || length > self->read_max || le32(c + 48) != length)
        return 0;
    for (int i = 56; i < 80; i++) /* offset, handle, reserved, length: all 0 for COPY */
        if (c[i])
            return 0;
    return find_region(self, le32(c + 36), le64(c + 24), length, REGION_READ) &&
           find_region(self, le32(c + 52), le64(c + 40), length, REGION_WRITE) &&
           !core_has(self, job_id);
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

static const char LATE[] = "job deadline exceeded"; /* the pipeline's words for it */

/* Write a COMPLETION (docs/data-plane.md 2.4) at `out`; its length. */
static uint32_t put_completion(uint8_t *out, uint64_t job_id, uint8_t state, uint16_t status,
                               uint64_t bytes_read, uint64_t bytes_written, uint64_t submit_ns,
                               uint64_t start_ns, uint64_t end_ns, const char *message)
{
    uint32_t msg_len = message ? (uint32_t)strlen(message) : 0;
    memset(out, 0, 80);
    out[0] = 'D';
    out[1] = 'C';
    out[2] = 1;
    out[3] = 3; /* COMPLETION */
    put32(out + 4, 80 + msg_len);
    put64(out + 8, job_id);
    put16(out + 16, status);
    out[18] = state;
    put16(out + 20, (uint16_t)msg_len);
    put64(out + 24, bytes_read);
    put64(out + 32, bytes_written);
    put64(out + 48, submit_ns);
    put64(out + 56, start_ns);
    put64(out + 64, end_ns);
    if (msg_len)
        memcpy(out + 80, message, msg_len);
    return 80 + msg_len;
}

/* read_setup(addr, lkey, slot_bytes, slots, max_bytes, default_deadline_ms): the ring the
 * READ path uses, `slots` slots of `slot_bytes` (a COMPLETION, then up to `max_bytes` of
 * data at CORE_DATA), and the deadline of a job that names none. */
static PyObject *Qp_read_setup(Qp *self, PyObject *args)
{
    unsigned long long addr;
    unsigned int lkey, slot, slots, max_bytes, deadline_ms;
    if (!qp_live(self) || !PyArg_ParseTuple(args, "KIIIII", &addr, &lkey, &slot, &slots,
                                            &max_bytes, &deadline_ms))
        return NULL;
    if (self->read_slots) {
        PyErr_SetString(PyExc_ValueError, "the READ ring is already set up");
        return NULL;
    }
    if (!addr || !slots || slots > (1u << 20) || !max_bytes || slot < CORE_DATA ||
        slot - CORE_DATA < max_bytes) {
        PyErr_SetString(PyExc_ValueError, "READ ring geometry does not fit its jobs");
        return NULL;
    }
    self->core = PyMem_Calloc(slots, sizeof(CoreJob));
    if (!self->core)
        return PyErr_NoMemory();
    self->read_addr = addr;
    self->read_lkey = lkey;
    self->read_slot = slot;
    self->read_slots = slots;
    self->read_max = max_bytes;
    self->default_deadline_ns = (uint64_t)deadline_ms * 1000000u;
    Py_RETURN_NONE;
}

static void core_free(Qp *self, CoreJob *j)
{
    j->state = CORE_FREE;
    self->core_busy--;
}

/* Start a READ-path COPY (core_copy said yes; a slot is free): take a slot, add the job
 * to `started`, repost the capsule's RECV and post the READ. 0, or -1 with an
 * exception; *err is the errno of a repost or post that failed (the job is in `started`
 * and its slot free again: nothing of it is out). */
static int core_start(Qp *self, const uint8_t *c, uint64_t slot, uint64_t submit_ns,
                      PyObject *started, int *err)
{
    uint32_t idx = 0;
    while (self->core[idx].state != CORE_FREE)
        idx++;
    CoreJob *j = &self->core[idx];
    uint64_t job_id = le64(c + 8), src = le64(c + 24), dst = le64(c + 40);
    uint32_t length = le32(c + 32), src_rkey = le32(c + 36), dst_rkey = le32(c + 52);
    uint32_t deadline_ms = le32(c + 20);
    uint64_t start_ns = realtime_ns();
    *j = (CoreJob){.job_id = job_id, .dst = dst, .submit_ns = submit_ns, .start_ns = start_ns,
                   .deadline_ns = now_ns() + (deadline_ms ? deadline_ms * UINT64_C(1000000)
                                                          : self->default_deadline_ns),
                   .length = length, .dst_rkey = dst_rkey, .state = CORE_READING};
    self->core_busy++;
    PyObject *job = Py_BuildValue("(KIKIKIIKK)", (unsigned long long)job_id, length,
                                  (unsigned long long)src, src_rkey, (unsigned long long)dst,
                                  dst_rkey, deadline_ms, (unsigned long long)submit_ns,
                                  (unsigned long long)start_ns);
    if (!job || PyList_Append(started, job) < 0) {
        Py_XDECREF(job);
        core_free(self, j);
        return -1;
    }
    Py_DECREF(job);
    *err = repost(self, slot);
    if (!*err) {
        struct ibv_sge sge = {.addr = self->read_addr + (uint64_t)idx * self->read_slot + CORE_DATA,
                              .length = length, .lkey = self->read_lkey};
        struct ibv_send_wr wr = {.wr_id = CORE_WR | (uint64_t)idx << 2 | CORE_OP_READ,
                                 .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
                                 .send_flags = IBV_SEND_SIGNALED};
        wr.wr.rdma.remote_addr = src;
        wr.wr.rdma.rkey = src_rkey;
        *err = do_post(self, &wr);
    }
    if (*err)
        core_free(self, j);
    return 0;
}

/* A successful completion of the READ path's: a READING job's READ has landed, so its
 * WRITE and COMPLETION go out in one post and the job goes on the done list (a job past
 * its deadline gets DEADLINE_EXCEEDED and no WRITE, as the pipeline checks before each
 * step); a DROPPED job's READ, or a job's SEND, frees its slot. 0, -1 with an
 * exception, or the errno of a post that failed (the job's slot is free again and it
 * is not on the done list: the pipeline ends it with the link). */
static int core_completion(Qp *self, uint64_t wr_id)
{
    uint64_t idx = (wr_id & ~CORE_WR) >> 2;
    int op = (int)(wr_id & 3);
    if (idx >= self->read_slots)
        return 0;
    CoreJob *j = &self->core[idx];
    if (op == CORE_OP_SEND) {
        if (j->state == CORE_SENDING)
            core_free(self, j);
        return 0;
    }
    if (op != CORE_OP_READ || (j->state != CORE_READING && j->state != CORE_DROPPED))
        return 0;
    if (j->state == CORE_DROPPED) {
        core_free(self, j);
        return 0;
    }
    if (!self->core_done && !(self->core_done = PyList_New(0)))
        return -1;
    uint8_t *out = (uint8_t *)(uintptr_t)(self->read_addr + idx * self->read_slot);
    int late = now_ns() > j->deadline_ns;
    uint64_t end_ns = realtime_ns();
    /* made before the post: once the COMPLETION is out, the job must reach the list */
    PyObject *done = Py_BuildValue("(KKi)", (unsigned long long)j->job_id,
                                   (unsigned long long)end_ns, late);
    if (!done)
        return -1;
    uint32_t size = late ? put_completion(out, j->job_id, 4 /* FAILED */, 4 /* DEADLINE_EXCEEDED */,
                                          j->length, 0, j->submit_ns, j->start_ns, end_ns, LATE)
                         : put_completion(out, j->job_id, 3 /* SUCCEEDED */, 0, j->length,
                                          j->length, j->submit_ns, j->start_ns, end_ns, NULL);
    struct ibv_sge sges[2] = {{.addr = (uintptr_t)(out + CORE_DATA), .length = j->length,
                               .lkey = self->read_lkey},
                              {.addr = (uintptr_t)out, .length = size, .lkey = self->read_lkey}};
    struct ibv_send_wr send = {.wr_id = CORE_WR | idx << 2 | CORE_OP_SEND, .sg_list = &sges[1],
                               .num_sge = 1, .opcode = IBV_WR_SEND,
                               .send_flags = IBV_SEND_SIGNALED};
    struct ibv_send_wr write = {.wr_id = CORE_WR | idx << 2 | CORE_OP_WRITE, .next = &send,
                                .sg_list = &sges[0], .num_sge = 1,
                                .opcode = IBV_WR_RDMA_WRITE};
    write.wr.rdma.remote_addr = j->dst;
    write.wr.rdma.rkey = j->dst_rkey;
    int partly = 0;
    int err = do_post_chain(self, late ? &send : &write, &partly);
    if (err) {
        Py_DECREF(done);
        /* The WRITE went out and its SEND did not: the device may still read the slot, so
         * it stays taken (SENDING, with no SEND to free it); the link fails on this. */
        if (partly)
            j->state = CORE_SENDING;
        else
            core_free(self, j);
        return err;
    }
    j->state = CORE_SENDING;
    int appended = PyList_Append(self->core_done, done);
    Py_DECREF(done);
    return appended < 0 ? -1 : 0;
}

/* serve(budget, next_wr_id, room, job_room)
 *     -> (next_wr_id, jobs, started, pending, errno, inline_failed)
 *
 * The agent's fast path, while the pipeline allows it (every job it holds open is one
 * the core started, nothing queued to send): takes up to `budget` capsules from the
 * receive CQ and runs each COPY it can, while the send queue has `room` for it and
 * `job_room` queue slots are free:
 * - an inline COPY (a fast slot free) to its end: its data goes from the RECV buffer
 *   into a fast slot after the slot's COMPLETION, the RECV is reposted, and the WRITE
 *   (unsignalled) and the COMPLETION's SEND (signalled) go in one post, wr_ids
 *   next_wr_id and next_wr_id + 1. `jobs` are these, finished and answered:
 *   (job_id, length, dst_addr, dst_rkey, deadline_ms, submit_ns, start_ns, end_ns,
 *   write_wr_id);
 * - a COPY READ from the host, of at most read_max bytes (a READ slot free): its READ is
 *   posted and the RECV reposted, and the job stays open until poll_send takes the
 *   READ's completion and posts its WRITE and COMPLETION. `started` are these, for the
 *   pipeline to hold open: (job_id, length, src_addr, src_rkey, dst_addr, dst_rkey,
 *   deadline_ms, submit_ns, start_ns).
 * The first capsule that is anything else stops the pass and comes back as `pending`
 * (slot, status, byte_len), for the pipeline to take next: capsules are handled in the
 * order they arrived. A post or repost that failed stops the pass with its errno; the
 * job it carried is the last of `jobs` if `inline_failed`, else the last of `started`
 * (the link has failed). */
static PyObject *Qp_serve(Qp *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t next_id;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "serve(budget, next_wr_id, room, job_room)");
        return NULL;
    }
    long budget = PyLong_AsLong(args[0]);
    long room = PyLong_AsLong(args[2]);
    long job_room = PyLong_AsLong(args[3]);
    if (!qp_live(self) || (budget == -1 && PyErr_Occurred()) || !parse_u64(args[1], &next_id) ||
        (room == -1 && PyErr_Occurred()) || (job_room == -1 && PyErr_Occurred()))
        return NULL;
    PyObject *jobs = PyList_New(0);
    PyObject *started = PyList_New(0);
    PyObject *pending = NULL;
    if (!jobs || !started)
        goto error;
    int err = 0, inline_failed = 0;
    while (FAST_PATH && budget-- > 0) {
        uint64_t slot = 0;
        int status = 0;
        uint32_t n = 0;
        int rc = take_recv(self, &slot, &status, &n);
        if (rc <= 0)
            break; /* empty (or an error code, read as empty as poll_recv does) */
        uint64_t submit_ns = realtime_ns();
        const uint8_t *c = (const uint8_t *)(uintptr_t)(self->recv_addr +
                                                        (slot % self->recv_depth) * self->recv_slot);
        /* Without room for a WRITE and a SEND, a free queue slot or a free fast or READ
         * slot, the pipeline takes the job: it queues what cannot be posted yet, refuses
         * a SUBMIT beyond the credits, and keeps the spec's bound on COMPLETIONs that
         * wait (DP-2.6-6), which a core that stopped reading would not. */
        int usable = status == IBV_WC_SUCCESS && slot < self->recv_depth &&
                     n <= self->recv_slot && room >= 2 && job_room > 0;
        if (usable && self->core_busy < self->read_slots && core_copy(self, c, n)) {
            if (core_start(self, c, slot, submit_ns, started, &err) < 0)
                goto error;
            room -= CORE_WRS;
            job_room--;
            if (err)
                break;
            continue;
        }
        if (!usable || self->fast_used >= self->fast_slots || !fast_copy(self, c, n)) {
            pending = Py_BuildValue("(KiI)", (unsigned long long)slot, status, n);
            if (!pending)
                goto error;
            break;
        }
        uint64_t start_ns = realtime_ns();
        uint32_t length = n - 80;
        uint32_t index = (self->fast_head + self->fast_used) % self->fast_slots;
        uint8_t *out = (uint8_t *)(uintptr_t)(self->fast_addr + (uint64_t)index * self->fast_slot);
        uint64_t job_id = le64(c + 8), dst = le64(c + 40);
        uint32_t rkey = le32(c + 52), deadline_ms = le32(c + 20);
        memcpy(out + 80, c + 80, length);
        err = repost(self, slot);
        uint64_t end_ns = realtime_ns();
        /* bytes_read: the inline source */
        put_completion(out, job_id, 3 /* SUCCEEDED */, 0, length, length, submit_ns, start_ns,
                       end_ns, NULL);
        PyObject *job = Py_BuildValue("(KIKIIKKKK)", (unsigned long long)job_id, length,
                                      (unsigned long long)dst, rkey, deadline_ms,
                                      (unsigned long long)submit_ns,
                                      (unsigned long long)start_ns,
                                      (unsigned long long)end_ns, (unsigned long long)next_id);
        if (!job || PyList_Append(jobs, job) < 0) {
            Py_XDECREF(job);
            goto error;
        }
        Py_DECREF(job);
        if (err) {
            inline_failed = 1;
            break;
        }
        struct ibv_sge sges[2] = {{.addr = (uintptr_t)(out + 80), .length = length,
                                   .lkey = self->fast_lkey},
                                  {.addr = (uintptr_t)out, .length = 80, .lkey = self->fast_lkey}};
        struct ibv_send_wr send = {.wr_id = next_id + 1, .sg_list = &sges[1], .num_sge = 1,
                                   .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
        struct ibv_send_wr write = {.wr_id = next_id, .next = &send, .sg_list = &sges[0],
                                    .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE};
        write.wr.rdma.remote_addr = dst;
        write.wr.rdma.rkey = rkey;
        self->fast_send_id[index] = next_id + 1;
        self->fast_used++;
        next_id += 2;
        room -= 2;
        err = do_post(self, &write);
        if (err) {
            inline_failed = 1;
            break;
        }
    }
    PyObject *result = Py_BuildValue("(KNNOii)", (unsigned long long)next_id, jobs, started,
                                     pending ? pending : Py_None, err, inline_failed);
    Py_XDECREF(pending);
    return result;
error:
    Py_XDECREF(jobs);
    Py_XDECREF(started);
    Py_XDECREF(pending);
    return NULL;
}

/* Whether `job_id` is on the done list: answered, not taken yet (its slot may be free
 * already, its SEND having completed). */
static int core_answered_id(Qp *self, uint64_t job_id)
{
    PyObject *done = self->core_done;
    for (Py_ssize_t i = 0; done && i < PyList_GET_SIZE(done); i++) {
        PyObject *id = PyTuple_GET_ITEM(PyList_GET_ITEM(done, i), 0);
        if (PyLong_AsUnsignedLongLong(id) == job_id)
            return 1;
    }
    return 0;
}

/* core_cancel(job_id) -> bool: the pipeline ends a job the core started (CANCEL, its
 * deadline, the link failed, the session closes). True: the core will not WRITE for it
 * (its READ, if out, keeps the slot until it completed); False: its COMPLETION was
 * posted already, finished (the pipeline takes it from the done list, take_done). Its
 * SEND may have completed, freeing the slot, before the done list was taken: the list
 * is looked at too, or such a job would be ended twice. */
static PyObject *Qp_core_cancel(Qp *self, PyObject *arg)
{
    uint64_t job_id;
    if (!parse_u64(arg, &job_id))
        return NULL;
    int sent = 0;
    for (uint32_t i = 0; i < self->read_slots; i++) {
        CoreJob *j = &self->core[i];
        if (j->job_id != job_id)
            continue;
        if (j->state == CORE_READING) {
            j->state = CORE_DROPPED;
            Py_RETURN_TRUE;
        }
        sent |= j->state == CORE_SENDING;
    }
    return PyBool_FromLong(!sent && !core_answered_id(self, job_id));
}

/* take_done() -> [(job_id, end_ns, late), ...] or None: the READ-path jobs whose
 * COMPLETION the core posted since the last call (late: DEADLINE_EXCEEDED). */
static PyObject *Qp_take_done(Qp *self, PyObject *unused)
{
    PyObject *done = self->core_done;
    if (!done || !PyList_GET_SIZE(done))
        Py_RETURN_NONE;
    self->core_done = NULL;
    return done;
}

/* wait_any(timeout_ns) -> bool: whether a completion is there, of either queue, waiting
 * up to `timeout_ns` for one with the GIL released. It stays for the next poll_recv,
 * serve or spin_recv (a receive), or poll_send (a send-queue completion: a READ's data
 * landed, a WRITE and its SEND went out): an agent's reactor with nothing else to do
 * waits here instead of making empty passes. */
static PyObject *Qp_wait_any(Qp *self, PyObject *arg)
{
    if (!qp_live(self))
        return NULL;
    unsigned long long timeout = PyLong_AsUnsignedLongLong(arg);
    if (timeout == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (self->stashed || self->send_stashed)
        Py_RETURN_TRUE;
    uint64_t wr_id = 0;
    int status = 0, rc = 0, sent = 0;
    uint32_t byte_len = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = spin(self, timeout, 1, &wr_id, &status, &byte_len, &sent);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return poll_error(rc);
    if (rc == 0)
        Py_RETURN_FALSE;
    if (sent) {
        self->send_stashed = 1;
        self->send_stash_wr_id = wr_id;
        self->send_stash_status = status;
    } else {
        stash_recv(self, wr_id, status, byte_len);
    }
    Py_RETURN_TRUE;
}

/* close(): forget the pointers (pyverbs destroys the resources). Idempotent. */
static PyObject *Qp_close(Qp *self, PyObject *unused)
{
    self->live = 0;
    self->qp = NULL;
    self->send_cq = self->recv_cq = NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Qp_methods[] = {
    {"send_copy", (PyCFunction)(void (*)(void))Qp_send_copy, METH_FASTCALL,
     "send_copy(wr_id, addr, room, lkey, head, tail) -> errno: copy into a slot, SEND it"},
    {"post_rdma", (PyCFunction)(void (*)(void))Qp_post_rdma, METH_FASTCALL,
     "post_rdma(wr_id, read, addr, length, lkey, remote_addr, rkey, signaled) -> errno"},
    {"post_chain", (PyCFunction)(void (*)(void))Qp_post_chain, METH_FASTCALL,
     "post_chain(write_id, addr, length, lkey, remote_addr, rkey, send_id, send_addr, "
     "send_length, send_lkey) -> errno: an unsignalled WRITE then a signalled SEND"},
    {"post_recv", (PyCFunction)Qp_post_recv, METH_O, "post_recv(slot) -> errno"},
    {"poll_send", (PyCFunction)Qp_poll_send, METH_NOARGS,
     "poll_send() -> (wr_id, status) or None"},
    {"poll_recv", (PyCFunction)Qp_poll_recv, METH_NOARGS,
     "poll_recv() -> (slot, status, byte_len) or None"},
    {"spin_recv", (PyCFunction)Qp_spin_recv, METH_O,
     "spin_recv(timeout_ns) -> (slot, status, byte_len) or None, the GIL released"},
    {"call", (PyCFunction)(void (*)(void))Qp_call, METH_FASTCALL,
     "call(wr_id, addr, room, lkey, head, tail, job_id, timeout_ns) -> fields or None: "
     "SEND, then take job_id's COMPLETION if it comes within the timeout"},
    {"fast_setup", (PyCFunction)Qp_fast_setup, METH_VARARGS,
     "fast_setup(addr, lkey, slot_bytes, slots, inline_max): the agent's fast ring"},
    {"set_regions", (PyCFunction)Qp_set_regions, METH_O,
     "set_regions([(addr, length, rkey, access), ...]): the regions fast jobs may use"},
    {"read_setup", (PyCFunction)Qp_read_setup, METH_VARARGS,
     "read_setup(addr, lkey, slot_bytes, slots, max_bytes, default_deadline_ms): the READ ring"},
    {"serve", (PyCFunction)(void (*)(void))Qp_serve, METH_FASTCALL,
     "serve(budget, next_wr_id, room, job_room) -> "
     "(next_wr_id, jobs, started, pending, errno, inline_failed)"},
    {"core_cancel", (PyCFunction)Qp_core_cancel, METH_O,
     "core_cancel(job_id) -> bool: False if the job's COMPLETION was posted already"},
    {"take_done", (PyCFunction)Qp_take_done, METH_NOARGS,
     "take_done() -> [(job_id, end_ns, late), ...] or None: READ-path jobs answered"},
    {"wait_any", (PyCFunction)Qp_wait_any, METH_O,
     "wait_any(timeout_ns) -> bool: a completion of either queue is there (kept for the next poll)"},
    {"close", (PyCFunction)Qp_close, METH_NOARGS, "forget the pointers; idempotent"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Qp_members[] = {
    {"recv_errno", T_INT, offsetof(Qp, recv_errno), READONLY,
     "the errno of call()'s last RECV repost (0: it succeeded)"},
    {"core_busy", T_UINT, offsetof(Qp, core_busy), READONLY,
     "READ ring slots in use (a job open, dropped with its READ out, or sending)"},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *Qp_core_wrs(Qp *self, void *unused)
{
    return PyLong_FromUnsignedLong(self->core_busy * CORE_WRS);
}

static PyObject *Qp_core_answered(Qp *self, void *unused)
{
    return PyLong_FromSsize_t(self->core_done ? PyList_GET_SIZE(self->core_done) : 0);
}

static PyGetSetDef Qp_getset[] = {
    {"core_wrs", (getter)Qp_core_wrs, NULL,
     "send-queue entries the READ path's jobs hold (2 each, from READ to SEND)", NULL},
    {"core_answered", (getter)Qp_core_answered, NULL,
     "READ-path jobs answered that take_done() has not yet returned", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static void Qp_dealloc(Qp *self)
{
    PyMem_Free(self->fast_send_id);
    PyMem_Free(self->regions);
    PyMem_Free(self->core);
    Py_XDECREF(self->core_done);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject QpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dpu_wire.transport._vcore.Qp",
    .tp_basicsize = sizeof(Qp),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Posts and polls of one RC QP whose resources pyverbs owns.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Qp_dealloc,
    .tp_init = (initproc)Qp_init,
    .tp_methods = Qp_methods,
    .tp_members = Qp_members,
    .tp_getset = Qp_getset,
};

static PyMethodDef module_methods[] = {
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_vcore",
    .m_doc = "The verbs transport's per-operation calls in C (see dpu_wire/transport/native.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__vcore(void)
{
    if (PyType_Ready(&QpType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&QpType);
    if (PyModule_AddObject(m, "Qp", (PyObject *)&QpType) < 0) {
        Py_DECREF(&QpType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
