/* A stand-in verbs provider for tests of the native core (dpu_wire/transport/_vcore.c).
 *
 * ibv_post_send, ibv_post_recv and the extended CQ's polls are inline functions of
 * <infiniband/verbs.h> that call through the context's and the CQ's function pointers,
 * so a core given these objects posts to `posted` and polls what a test queued with
 * push_send / push_recv: its state machine runs with no device. Built by
 * tests/unit/test_vcore_states.py with the compiler Python builds extensions with. */
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t wr_id;
    int status;
    uint32_t byte_len;
} Cqe;

typedef struct {
    Cqe q[256];
    unsigned head, tail;
    Cqe cur;
} Queue;

typedef struct {
    uint64_t wr_id;
    int opcode;
    int flags;
    uint64_t addr;
    uint32_t length;
    uint64_t remote_addr;
    uint32_t rkey;
} Posted;

static struct ibv_context ctx;
static struct ibv_qp qp;
static struct ibv_cq_ex send_cq, recv_cq;
static Queue sends, recvs;

Posted posted[1024]; /* every send work request accepted, in order */
int n_posted;
int refuse_at = -1; /* refuse the request at this index of the next post call (ENOMEM) */
int n_recv_posts;

static Queue *queue_of(struct ibv_cq_ex *cq) { return cq == &send_cq ? &sends : &recvs; }

static int take(struct ibv_cq_ex *cq)
{
    Queue *q = queue_of(cq);
    if (q->head == q->tail)
        return ENOENT;
    q->cur = q->q[q->head++ % 256];
    cq->wr_id = q->cur.wr_id;
    cq->status = q->cur.status;
    return 0;
}

static int start_poll(struct ibv_cq_ex *cq, struct ibv_poll_cq_attr *attr)
{
    (void)attr;
    return take(cq);
}

static void end_poll(struct ibv_cq_ex *cq) { (void)cq; }

static uint32_t read_byte_len(struct ibv_cq_ex *cq) { return queue_of(cq)->cur.byte_len; }

static int post_send(struct ibv_qp *q, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    (void)q;
    for (int i = 0; wr; wr = wr->next, i++) {
        if (i == refuse_at || n_posted == 1024) {
            refuse_at = -1;
            *bad = wr;
            return ENOMEM;
        }
        posted[n_posted++] = (Posted){wr->wr_id,        wr->opcode,
                                      wr->send_flags,   wr->sg_list->addr,
                                      wr->sg_list->length, wr->wr.rdma.remote_addr,
                                      wr->wr.rdma.rkey};
    }
    return 0;
}

static int post_recv(struct ibv_qp *q, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    (void)q;
    (void)wr;
    (void)bad;
    n_recv_posts++;
    return 0;
}

/* Fresh objects and empty queues; the queue pair's address (for _vcore.Qp). */
uintptr_t fake_reset(void)
{
    memset(&sends, 0, sizeof sends);
    memset(&recvs, 0, sizeof recvs);
    n_posted = n_recv_posts = 0;
    refuse_at = -1;
    ctx.ops.post_send = post_send;
    ctx.ops.post_recv = post_recv;
    send_cq.context = recv_cq.context = &ctx;
    send_cq.start_poll = recv_cq.start_poll = start_poll;
    send_cq.next_poll = recv_cq.next_poll = take;
    send_cq.end_poll = recv_cq.end_poll = end_poll;
    send_cq.read_byte_len = recv_cq.read_byte_len = read_byte_len;
    qp.context = &ctx;
    qp.qp_num = 1;
    qp.send_cq = (struct ibv_cq *)&send_cq;
    qp.recv_cq = (struct ibv_cq *)&recv_cq;
    return (uintptr_t)&qp;
}

uintptr_t fake_send_cq(void) { return (uintptr_t)&send_cq; }
uintptr_t fake_recv_cq(void) { return (uintptr_t)&recv_cq; }

void push_send(uint64_t wr_id, int status) { sends.q[sends.tail++ % 256] = (Cqe){wr_id, status, 0}; }

void push_recv(uint64_t wr_id, int status, uint32_t byte_len)
{
    recvs.q[recvs.tail++ % 256] = (Cqe){wr_id, status, byte_len};
}
