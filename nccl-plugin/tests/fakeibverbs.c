/* A fake libibverbs.so.1 for the plugin's ABI tests: no machine we have has an RDMA device, so
 * the RDMA path runs against this. Compiled by tests/support against the real
 * <infiniband/verbs.h>, so every struct the plugin reads or fills has the real layout, and the
 * data-path calls go through context->ops exactly as verbs.h's inline wrappers make them.
 *
 * Devices: one ("fake_ib0", port 1 ACTIVE) when VGPU_FAKE_IBV_DEVICES=1, else none.
 * VGPU_FAKE_IBV_PORT_DOWN=1 leaves the port DOWN; VGPU_FAKE_IBV_LINK=eth makes it RoCE (LID 0,
 * the GID must be used). VGPU_FAKE_IBV_VERBOSE=1 prints each QP's counters when it is
 * destroyed.
 *
 * RC queue pairs between processes: each QP listens on the abstract Unix socket
 * "fakeibv/<qpn>" (QPNs are unique on the host: a taken name is a taken number). Once a QP is
 * RTS, its send thread (the requester) connects to the destination QP's socket, introduces
 * itself (its QPN and first PSN, which the responder checks against what RTR was given) and
 * executes the send queue in order: each RDMA write is read from local memory (lkey checked)
 * when it executes and framed onto the socket. The destination's receive thread (the
 * responder) checks the rkey, remote-write access and bounds against the MRs of its process,
 * places the bytes, and for a write with immediate consumes the oldest posted receive and
 * pushes its completion (opcode RECV_RDMA_WITH_IMM, byte_len, imm) before it acknowledges.
 * The requester completes a work request only on that acknowledgement. Errors follow RC: a bad
 * rkey is REM_ACCESS_ERR, a write with immediate without a posted receive RNR_RETRY_EXC_ERR (no
 * RNR retries here), an unreachable peer RETRY_EXC_ERR; the failing work request completes
 * with that status, both QPs go to the error state and what is still queued is flushed
 * (WR_FLUSH_ERR). Only RDMA WRITE and WRITE_WITH_IMM with at most one scatter entry exist. */
#define _GNU_SOURCE
#include <infiniband/verbs.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* verbs.h wraps these three in macros; the library exports the functions themselves */
#undef ibv_get_device_list
#undef ibv_query_port
#undef ibv_reg_mr

static int env_is(const char *name, const char *value) {
    const char *v = getenv(name);
    return v && strcmp(v, value) == 0;
}

static int ethernet(void) { return env_is("VGPU_FAKE_IBV_LINK", "eth"); }

/* ---- devices ---- */

static struct ibv_device fake_device;
static struct ibv_device *device_list[2];

struct ibv_device **ibv_get_device_list(int *num) {
    int n = env_is("VGPU_FAKE_IBV_DEVICES", "1") ? 1 : 0;
    strcpy(fake_device.name, "fake_ib0");
    strcpy(fake_device.dev_name, "uverbs0");
    fake_device.node_type = IBV_NODE_CA;
    fake_device.transport_type = IBV_TRANSPORT_IB;
    device_list[0] = n ? &fake_device : NULL;
    device_list[1] = NULL;
    if (num) *num = n;
    return device_list;
}

void ibv_free_device_list(struct ibv_device **list) { (void)list; }

const char *ibv_get_device_name(struct ibv_device *d) { return d->name; }

static int poll_cq_op(struct ibv_cq *cq, int n, struct ibv_wc *wc);
static int post_send_op(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
static int post_recv_op(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);

struct ibv_context *ibv_open_device(struct ibv_device *d) {
    if (d != &fake_device) {
        errno = ENODEV;
        return NULL;
    }
    struct ibv_context *c = calloc(1, sizeof *c);
    c->device = d;
    c->cmd_fd = -1;
    c->async_fd = -1;
    c->num_comp_vectors = 1;
    pthread_mutex_init(&c->mutex, NULL);
    c->ops.poll_cq = poll_cq_op;
    c->ops.post_send = post_send_op;
    c->ops.post_recv = post_recv_op;
    return c;
}

int ibv_close_device(struct ibv_context *c) {
    free(c);
    return 0;
}

#define GID_TABLE 2

static void fake_gid(int index, union ibv_gid *gid) {
    memset(gid, 0, sizeof *gid);
    gid->raw[0] = 0xfe;
    gid->raw[1] = 0x80;
    gid->raw[14] = 0xfa;
    gid->raw[15] = (uint8_t)(0xce + index);
}

int ibv_query_port(struct ibv_context *c, uint8_t port, struct _compat_ibv_port_attr *out) {
    (void)c;
    if (port != 1) return EINVAL;
    /* the compatible prefix: every field up to link_layer and flags */
    struct ibv_port_attr *a = (struct ibv_port_attr *)out;
    a->state = env_is("VGPU_FAKE_IBV_PORT_DOWN", "1") ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
    a->max_mtu = IBV_MTU_4096;
    a->active_mtu = IBV_MTU_4096;
    a->gid_tbl_len = GID_TABLE;
    a->max_msg_sz = 1u << 30;
    a->lid = ethernet() ? 0 : 1;
    a->link_layer = ethernet() ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
    return 0;
}

int ibv_query_gid(struct ibv_context *c, uint8_t port, int index, union ibv_gid *gid) {
    (void)c;
    if (port != 1 || index < 0 || index >= GID_TABLE) return -1;
    fake_gid(index, gid);
    return 0;
}

struct ibv_pd *ibv_alloc_pd(struct ibv_context *c) {
    struct ibv_pd *pd = calloc(1, sizeof *pd);
    pd->context = c;
    return pd;
}

int ibv_dealloc_pd(struct ibv_pd *pd) {
    free(pd);
    return 0;
}

/* ---- memory regions: one table per process ---- */

struct region {
    struct ibv_mr *mr;
    uint64_t addr, len;
    int access;
};

static pthread_mutex_t mr_lock = PTHREAD_MUTEX_INITIALIZER;
static struct region *regions;
static size_t nregions;
static uint32_t next_key = 0x100;

static struct ibv_mr *register_region(struct ibv_pd *pd, uint64_t addr, size_t len, int access) {
    if (!pd || len == 0) {
        errno = EINVAL;
        return NULL;
    }
    struct ibv_mr *mr = calloc(1, sizeof *mr);
    mr->context = pd->context;
    mr->pd = pd;
    mr->addr = (void *)(uintptr_t)addr;
    mr->length = len;
    pthread_mutex_lock(&mr_lock);
    mr->lkey = next_key++;
    mr->rkey = mr->lkey ^ 0x5a0000;
    regions = realloc(regions, (nregions + 1) * sizeof *regions);
    regions[nregions++] = (struct region){mr, addr, len, access};
    pthread_mutex_unlock(&mr_lock);
    return mr;
}

struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access) {
    return register_region(pd, (uint64_t)(uintptr_t)addr, len, access);
}

/* No dma-buf importer here: the region is the application's address range `iova`, and the
 * descriptor must merely be open. */
struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova,
                                 int fd, int access) {
    (void)offset;
    if (fd < 0 || fcntl(fd, F_GETFD) < 0) {
        errno = EBADF;
        return NULL;
    }
    return register_region(pd, iova, len, access);
}

int ibv_dereg_mr(struct ibv_mr *mr) {
    pthread_mutex_lock(&mr_lock);
    for (size_t i = 0; i < nregions; i++) {
        if (regions[i].mr == mr) {
            regions[i] = regions[--nregions];
            break;
        }
    }
    pthread_mutex_unlock(&mr_lock);
    free(mr);
    return 0;
}

/* Whether [addr, addr+len) lies in one region with key `key` (an lkey, or an rkey allowing
 * remote writes). */
static int key_covers(uint32_t key, int remote, uint64_t addr, uint64_t len) {
    int ok = 0;
    pthread_mutex_lock(&mr_lock);
    for (size_t i = 0; i < nregions && !ok; i++) {
        struct region *r = &regions[i];
        if ((remote ? r->mr->rkey : r->mr->lkey) != key) continue;
        if (remote && !(r->access & IBV_ACCESS_REMOTE_WRITE)) break;
        ok = addr >= r->addr && addr + len >= addr && addr + len <= r->addr + r->len;
    }
    pthread_mutex_unlock(&mr_lock);
    return ok;
}

/* ---- completion queues ---- */

struct fake_cq {
    struct ibv_cq cq; /* first: the plugin sees this */
    pthread_mutex_t lock;
    struct ibv_wc *ring;
    int cap, head, count, overrun;
};

struct ibv_cq *ibv_create_cq(struct ibv_context *c, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int vector) {
    (void)vector;
    if (cqe <= 0 || channel) {
        errno = EINVAL;
        return NULL;
    }
    struct fake_cq *f = calloc(1, sizeof *f);
    f->cq.context = c;
    f->cq.cq_context = cq_context;
    f->cq.cqe = cqe;
    pthread_mutex_init(&f->lock, NULL);
    f->ring = calloc((size_t)cqe, sizeof *f->ring);
    f->cap = cqe;
    return &f->cq;
}

int ibv_destroy_cq(struct ibv_cq *cq) {
    struct fake_cq *f = (struct fake_cq *)cq;
    free(f->ring);
    free(f);
    return 0;
}

static void push_wc(struct ibv_cq *cq, const struct ibv_wc *wc) {
    struct fake_cq *f = (struct fake_cq *)cq;
    pthread_mutex_lock(&f->lock);
    if (f->count == f->cap) {
        f->overrun = 1; /* a real CQ overrun is an asynchronous error: polls fail from now */
    } else {
        f->ring[(f->head + f->count) % f->cap] = *wc;
        f->count++;
    }
    pthread_mutex_unlock(&f->lock);
}

static int poll_cq_op(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
    struct fake_cq *f = (struct fake_cq *)cq;
    pthread_mutex_lock(&f->lock);
    int got = 0;
    if (f->overrun) {
        got = -1;
    } else {
        while (got < n && f->count > 0) {
            wc[got++] = f->ring[f->head];
            f->head = (f->head + 1) % f->cap;
            f->count--;
        }
    }
    pthread_mutex_unlock(&f->lock);
    return got;
}

/* ---- queue pairs ---- */

struct send_wr {
    uint64_t wr_id, laddr, raddr;
    uint32_t len, lkey, rkey, imm;
    int with_imm, signaled;
};

struct frame { /* requester to responder, followed by `len` bytes */
    uint64_t raddr;
    uint32_t len, rkey, imm, with_imm;
};

struct hello { /* the requester's first bytes */
    uint32_t qpn, psn;
};

struct fake_qp {
    struct ibv_qp qp; /* first: the plugin sees this */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int state, stopping;
    uint32_t dest_qpn, rq_psn, sq_psn;
    struct send_wr *sq;
    int sq_cap, sq_head, sq_count;
    uint64_t *rq;
    int rq_cap, rq_head, rq_count;
    int listen_fd, in_fd, out_fd;
    pthread_t rx, tx;
    int tx_started;
    long writes, receives;
};

static void qp_error(struct fake_qp *q) {
    /* with q->lock held: flush every posted receive */
    q->state = IBV_QPS_ERR;
    while (q->rq_count > 0) {
        struct ibv_wc wc = {0};
        wc.wr_id = q->rq[q->rq_head];
        wc.status = IBV_WC_WR_FLUSH_ERR;
        wc.qp_num = q->qp.qp_num;
        q->rq_head = (q->rq_head + 1) % q->rq_cap;
        q->rq_count--;
        push_wc(q->qp.recv_cq, &wc);
    }
    pthread_cond_broadcast(&q->wake);
}

static int read_full(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int write_full(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void qp_address(uint32_t qpn, struct sockaddr_un *a, socklen_t *len) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "fakeibv/%u", qpn);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* The responder: one requester at a time, frames in order. */
static void *responder(void *arg) {
    struct fake_qp *q = arg;
    for (;;) {
        int fd = accept(q->listen_fd, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR) continue;
            return NULL; /* shut down by destroy */
        }
        pthread_mutex_lock(&q->lock);
        if (q->stopping) {
            pthread_mutex_unlock(&q->lock);
            close(fd);
            return NULL;
        }
        q->in_fd = fd;
        pthread_mutex_unlock(&q->lock);
        struct hello h;
        int accepted = read_full(fd, &h, sizeof h) == 0;
        pthread_mutex_lock(&q->lock);
        /* packets from a QP other than the one RTR named, or at another PSN, are dropped */
        accepted = accepted && (q->state == IBV_QPS_RTR || q->state == IBV_QPS_RTS) &&
                   h.qpn == q->dest_qpn && h.psn == q->rq_psn;
        pthread_mutex_unlock(&q->lock);
        while (accepted) {
            struct frame f;
            if (read_full(fd, &f, sizeof f) != 0) break;
            uint32_t status = IBV_WC_SUCCESS;
            if (f.len > 0 && !key_covers(f.rkey, 1, f.raddr, f.len)) status = IBV_WC_REM_ACCESS_ERR;
            if (status == IBV_WC_SUCCESS) {
                if (f.len > 0 && read_full(fd, (void *)(uintptr_t)f.raddr, f.len) != 0) break;
            } else {
                /* the bytes are not placed anywhere */
                char sink[4096];
                uint32_t left = f.len;
                while (left > 0) {
                    uint32_t n = left < sizeof sink ? left : sizeof sink;
                    if (read_full(fd, sink, n) != 0) break;
                    left -= n;
                }
            }
            pthread_mutex_lock(&q->lock);
            if (q->state == IBV_QPS_ERR) status = IBV_WC_WR_FLUSH_ERR;
            if (status == IBV_WC_SUCCESS && f.with_imm) {
                if (q->rq_count == 0) {
                    status = IBV_WC_RNR_RETRY_EXC_ERR;
                } else {
                    struct ibv_wc wc = {0};
                    wc.wr_id = q->rq[q->rq_head];
                    wc.status = IBV_WC_SUCCESS;
                    wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
                    wc.byte_len = f.len;
                    wc.imm_data = f.imm;
                    wc.wc_flags = IBV_WC_WITH_IMM;
                    wc.qp_num = q->qp.qp_num;
                    wc.src_qp = q->dest_qpn;
                    q->rq_head = (q->rq_head + 1) % q->rq_cap;
                    q->rq_count--;
                    q->receives++;
                    /* the data is in place before the completion is visible (the CQ's lock) */
                    push_wc(q->qp.recv_cq, &wc);
                }
            }
            if (status != IBV_WC_SUCCESS) qp_error(q);
            pthread_mutex_unlock(&q->lock);
            if (write_full(fd, &status, sizeof status) != 0 || status != IBV_WC_SUCCESS) break;
        }
        pthread_mutex_lock(&q->lock);
        q->in_fd = -1;
        pthread_mutex_unlock(&q->lock);
        close(fd);
    }
}

static void complete_send(struct fake_qp *q, const struct send_wr *w, uint32_t status) {
    if (status == IBV_WC_SUCCESS && !w->signaled) return;
    struct ibv_wc wc = {0};
    wc.wr_id = w->wr_id;
    wc.status = status;
    wc.opcode = IBV_WC_RDMA_WRITE;
    wc.byte_len = w->len;
    wc.qp_num = q->qp.qp_num;
    push_wc(q->qp.send_cq, &wc);
}

/* The requester: executes the send queue in order. */
static void *requester(void *arg) {
    struct fake_qp *q = arg;
    for (;;) {
        pthread_mutex_lock(&q->lock);
        while (!q->stopping && q->sq_count == 0) pthread_cond_wait(&q->wake, &q->lock);
        if (q->stopping) {
            pthread_mutex_unlock(&q->lock);
            return NULL;
        }
        struct send_wr w = q->sq[q->sq_head];
        int failed = q->state == IBV_QPS_ERR;
        int fd = q->out_fd;
        struct hello h = {q->qp.qp_num, q->sq_psn};
        uint32_t dest = q->dest_qpn;
        pthread_mutex_unlock(&q->lock);
        uint32_t status = IBV_WC_SUCCESS;
        if (failed) {
            status = IBV_WC_WR_FLUSH_ERR;
        } else if (w.len > 0 && !key_covers(w.lkey, 0, w.laddr, w.len)) {
            status = IBV_WC_LOC_PROT_ERR;
        } else {
            if (fd < 0) {
                struct sockaddr_un a;
                socklen_t alen;
                qp_address(dest, &a, &alen);
                fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
                if (connect(fd, (struct sockaddr *)&a, alen) != 0 ||
                    write_full(fd, &h, sizeof h) != 0) {
                    close(fd);
                    fd = -1;
                }
                pthread_mutex_lock(&q->lock);
                q->out_fd = fd;
                pthread_mutex_unlock(&q->lock);
            }
            struct frame f = {w.raddr, w.len, w.rkey, w.imm, (uint32_t)w.with_imm};
            if (fd < 0 || write_full(fd, &f, sizeof f) != 0 ||
                (w.len > 0 && write_full(fd, (void *)(uintptr_t)w.laddr, w.len) != 0) ||
                read_full(fd, &status, sizeof status) != 0) {
                status = IBV_WC_RETRY_EXC_ERR; /* the peer never acknowledged */
            }
        }
        pthread_mutex_lock(&q->lock);
        q->sq_head = (q->sq_head + 1) % q->sq_cap;
        q->sq_count--;
        if (status == IBV_WC_SUCCESS) q->writes++;
        else if (q->state != IBV_QPS_ERR) qp_error(q);
        complete_send(q, &w, status);
        pthread_mutex_unlock(&q->lock);
    }
}

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init) {
    if (!pd || init->qp_type != IBV_QPT_RC || init->srq || !init->send_cq || !init->recv_cq ||
        init->cap.max_send_wr == 0 || init->cap.max_recv_wr == 0 || init->cap.max_send_sge > 1 ||
        init->cap.max_recv_sge > 1) {
        errno = EINVAL;
        return NULL;
    }
    struct fake_qp *q = calloc(1, sizeof *q);
    q->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint32_t qpn = ((uint32_t)getpid() * 2654435761u ^ (uint32_t)t.tv_nsec) & 0xffffff;
    for (int tries = 0;; tries++, qpn = (qpn * 1103515245u + 12345u) & 0xffffff) {
        if (qpn < 2) continue; /* 0 and 1 are special QPs */
        struct sockaddr_un a;
        socklen_t alen;
        qp_address(qpn, &a, &alen);
        if (bind(q->listen_fd, (struct sockaddr *)&a, alen) == 0) break;
        if (errno != EADDRINUSE || tries > 1000) {
            close(q->listen_fd);
            free(q);
            errno = ENOMEM;
            return NULL;
        }
    }
    listen(q->listen_fd, 4);
    q->qp.context = pd->context;
    q->qp.qp_context = init->qp_context;
    q->qp.pd = pd;
    q->qp.send_cq = init->send_cq;
    q->qp.recv_cq = init->recv_cq;
    q->qp.qp_num = qpn;
    q->qp.state = IBV_QPS_RESET;
    q->qp.qp_type = IBV_QPT_RC;
    q->state = IBV_QPS_RESET;
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->wake, NULL);
    q->sq_cap = (int)init->cap.max_send_wr;
    q->sq = calloc((size_t)q->sq_cap, sizeof *q->sq);
    q->rq_cap = (int)init->cap.max_recv_wr;
    q->rq = calloc((size_t)q->rq_cap, sizeof *q->rq);
    q->in_fd = -1;
    q->out_fd = -1;
    pthread_create(&q->rx, NULL, responder, q);
    return &q->qp;
}

static int has(int mask, int want) { return (mask & want) == want; }

int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) {
    struct fake_qp *q = (struct fake_qp *)qp;
    if (!(mask & IBV_QP_STATE)) return EINVAL;
    int rc = 0;
    pthread_mutex_lock(&q->lock);
    int to = (int)a->qp_state;
    if (to == IBV_QPS_ERR) {
        qp_error(q);
    } else if (q->state == IBV_QPS_RESET && to == IBV_QPS_INIT) {
        if (!has(mask, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) || a->port_num != 1)
            rc = EINVAL;
    } else if (q->state == IBV_QPS_INIT && to == IBV_QPS_RTR) {
        int need = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        if (!has(mask, need) || a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096 ||
            a->ah_attr.port_num != 1 || a->dest_qp_num >= (1u << 24) || a->rq_psn >= (1u << 24)) {
            rc = EINVAL;
        } else if (ethernet()) {
            /* RoCE is routed by GID: the address must be global and name this fabric's GID at
             * the index the sender uses */
            union ibv_gid mine;
            fake_gid(a->ah_attr.grh.sgid_index, &mine);
            if (!a->ah_attr.is_global || a->ah_attr.grh.sgid_index >= GID_TABLE ||
                memcmp(&mine, &a->ah_attr.grh.dgid, sizeof mine) != 0)
                rc = EINVAL;
        } else if (a->ah_attr.dlid == 0) {
            rc = EINVAL; /* InfiniBand is routed by LID */
        }
        if (rc == 0) {
            q->dest_qpn = a->dest_qp_num;
            q->rq_psn = a->rq_psn;
        }
    } else if (q->state == IBV_QPS_RTR && to == IBV_QPS_RTS) {
        int need = IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                   IBV_QP_MAX_QP_RD_ATOMIC;
        if (!has(mask, need) || a->sq_psn >= (1u << 24)) rc = EINVAL;
        else q->sq_psn = a->sq_psn;
    } else {
        rc = EINVAL;
    }
    if (rc == 0 && to != IBV_QPS_ERR) {
        q->state = to;
        q->qp.state = (enum ibv_qp_state)to;
        if (to == IBV_QPS_RTS && !q->tx_started) {
            q->tx_started = 1;
            pthread_create(&q->tx, NULL, requester, q);
        }
    }
    pthread_mutex_unlock(&q->lock);
    return rc;
}

static int post_send_op(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
    struct fake_qp *q = (struct fake_qp *)qp;
    int rc = 0;
    pthread_mutex_lock(&q->lock);
    for (; wr; wr = wr->next) {
        if (q->state != IBV_QPS_RTS && q->state != IBV_QPS_ERR) rc = EINVAL;
        else if (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM)
            rc = EINVAL;
        else if (wr->num_sge < 0 || wr->num_sge > 1) rc = EINVAL;
        else if (q->sq_count == q->sq_cap) rc = ENOMEM;
        if (rc) break;
        struct send_wr w = {0};
        w.wr_id = wr->wr_id;
        if (wr->num_sge == 1) {
            w.laddr = wr->sg_list[0].addr;
            w.len = wr->sg_list[0].length;
            w.lkey = wr->sg_list[0].lkey;
        }
        w.raddr = wr->wr.rdma.remote_addr;
        w.rkey = wr->wr.rdma.rkey;
        w.imm = wr->imm_data;
        w.with_imm = wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
        w.signaled = (wr->send_flags & IBV_SEND_SIGNALED) != 0;
        q->sq[(q->sq_head + q->sq_count) % q->sq_cap] = w;
        q->sq_count++;
    }
    if (rc && bad) *bad = wr;
    pthread_cond_broadcast(&q->wake);
    pthread_mutex_unlock(&q->lock);
    return rc;
}

static int post_recv_op(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
    struct fake_qp *q = (struct fake_qp *)qp;
    int rc = 0;
    pthread_mutex_lock(&q->lock);
    for (; wr; wr = wr->next) {
        if (q->state == IBV_QPS_RESET || q->state == IBV_QPS_ERR) rc = EINVAL;
        else if (wr->num_sge < 0 || wr->num_sge > 1) rc = EINVAL;
        else if (q->rq_count == q->rq_cap) rc = ENOMEM;
        if (rc) break;
        q->rq[(q->rq_head + q->rq_count) % q->rq_cap] = wr->wr_id;
        q->rq_count++;
    }
    if (rc && bad) *bad = wr;
    pthread_mutex_unlock(&q->lock);
    return rc;
}

int ibv_destroy_qp(struct ibv_qp *qp) {
    struct fake_qp *q = (struct fake_qp *)qp;
    pthread_mutex_lock(&q->lock);
    q->stopping = 1;
    shutdown(q->listen_fd, SHUT_RDWR);
    if (q->in_fd >= 0) shutdown(q->in_fd, SHUT_RDWR);
    if (q->out_fd >= 0) shutdown(q->out_fd, SHUT_RDWR);
    pthread_cond_broadcast(&q->wake);
    pthread_mutex_unlock(&q->lock);
    pthread_join(q->rx, NULL);
    if (q->tx_started) pthread_join(q->tx, NULL);
    if (env_is("VGPU_FAKE_IBV_VERBOSE", "1"))
        fprintf(stderr, "fakeibv: qp %u destroyed: writes=%ld receives=%ld\n", q->qp.qp_num,
                q->writes, q->receives);
    close(q->listen_fd);
    if (q->out_fd >= 0) close(q->out_fd);
    free(q->sq);
    free(q->rq);
    free(q);
    return 0;
}
